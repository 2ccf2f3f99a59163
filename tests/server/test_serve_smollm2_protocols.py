"""End to end: the official `anthropic` SDK and the `openai` SDK's Responses client against a
real server over SmolLM2 on 127.0.0.1."""

from __future__ import annotations

from typing import Any

import anthropic
import openai
import pytest

from modelhost.assembly import build_serving
from modelhost.models.loaded import LoadedModel
from modelhost.server.settings import ServeSettings

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
ASK: list[Any] = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}  # current Anthropic SDKs send sampling fields only this way


@pytest.fixture(scope="module")
def server(smollm2: LoadedModel, module_live_server: Any) -> Any:
    return module_live_server(build_serving(smollm2, ServeSettings(), batch=4, max_queue=8))


def test_anthropic_sdk_message_and_stream_agree_on_a_greedy_answer(server: Any) -> None:
    with anthropic.Anthropic(
        base_url=server.base_url, api_key="unused", max_retries=0, timeout=120
    ) as client:
        message = client.messages.create(
            model=MODEL, max_tokens=12, messages=ASK, system="Answer briefly.", extra_body=GREEDY
        )
        with client.messages.stream(
            model=MODEL, max_tokens=12, messages=ASK, system="Answer briefly.", extra_body=GREEDY
        ) as stream:
            streamed = "".join(stream.text_stream)
            final = stream.get_final_message()
        counted = client.messages.count_tokens(model=MODEL, messages=ASK, system="Answer briefly.")
    text = message.content[0].text  # type: ignore[union-attr]
    assert text.strip()
    assert streamed == text
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert final.stop_reason == message.stop_reason
    assert final.usage.output_tokens == message.usage.output_tokens
    assert counted.input_tokens == message.usage.input_tokens


def test_openai_sdk_responses_chain_through_previous_response_id(server: Any) -> None:
    with openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120
    ) as client:
        first = client.responses.create(
            model=MODEL, input="My name is Ada.", max_output_tokens=8, temperature=0
        )
        events = list(
            client.responses.create(
                model=MODEL,
                input="What is my name?",
                previous_response_id=first.id,
                max_output_tokens=8,
                temperature=0,
                stream=True,
            )
        )
    assert first.output_text.strip()
    assert first.usage is not None and first.usage.output_tokens > 0
    completed = events[-1]
    assert completed.type in ("response.completed", "response.incomplete")  # 8 tokens may cut it
    second = completed.response  # type: ignore[union-attr]
    assert second.previous_response_id == first.id
    assert second.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    assert deltas == second.output_text
