"""The official `anthropic` SDK and the `openai` SDK's Responses client against a real uvicorn
server on a loopback port, over a scripted engine."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anthropic
import openai
import pytest
from scripted_engine import ScriptedEngine
from starlette.applications import Starlette

AppFactory = Callable[..., Starlette]
HELLO: list[Any] = [{"role": "user", "content": "hi"}]


def claude(base_url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key="none", max_retries=0, timeout=10)


def gpt(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=10)


def test_the_anthropic_sdk_reads_a_message(make_app: AppFactory, live_server: Any) -> None:
    server = live_server(make_app())
    with claude(server.base_url) as client:
        message = client.messages.create(model="scripted-model", max_tokens=32, messages=HELLO)
    assert message.content[0].type == "text"
    assert message.content[0].text == "Hello, world!"
    assert message.stop_reason == "end_turn"
    assert message.usage.output_tokens == 4


def test_the_anthropic_sdk_streams_text_and_assembles_the_final_message(
    make_app: AppFactory, live_server: Any
) -> None:
    server = live_server(make_app())
    with (
        claude(server.base_url) as client,
        client.messages.stream(model="scripted-model", max_tokens=2, messages=HELLO) as stream,
    ):
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "Hello,"
    assert final.content[0].text == "Hello,"  # type: ignore[union-attr]
    assert final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 2


def test_the_anthropic_sdk_sees_the_raw_events_in_order(
    make_app: AppFactory, live_server: Any
) -> None:
    server = live_server(make_app())
    with claude(server.base_url) as client:
        events = list(
            client.messages.create(
                model="scripted-model", max_tokens=32, messages=HELLO, stream=True
            )
        )
    kinds = [event.type for event in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_the_anthropic_sdk_counts_tokens_and_sends_sampling_through_extra_body(
    make_app: AppFactory, live_server: Any
) -> None:
    engine = ScriptedEngine()
    server = live_server(make_app(engine))
    with claude(server.base_url) as client:
        counted = client.messages.count_tokens(model="scripted-model", messages=HELLO)
        message = client.messages.create(
            model="scripted-model", max_tokens=8, messages=HELLO, extra_body={"top_k": 3}
        )
    assert counted.input_tokens == message.usage.input_tokens
    assert engine.submissions[-1].params.top_k == 3


def test_the_anthropic_sdk_raises_its_bad_request_error_for_a_malformed_body(
    make_app: AppFactory, live_server: Any
) -> None:
    server = live_server(make_app())
    with claude(server.base_url) as client, pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model="scripted-model", max_tokens=8, messages=[])
    assert caught.value.body == {  # type: ignore[comparison-overlap]
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "messages: at least one message is required",
            "param": "messages",
        },
    }


def test_the_openai_sdk_creates_streams_and_chains_responses(
    make_app: AppFactory, live_server: Any
) -> None:
    server = live_server(make_app())
    with gpt(server.base_url) as client:
        first = client.responses.create(model="scripted-model", input="hi", instructions="Be kind.")
        assert first.output_text == "Hello, world!"
        assert first.status == "completed"
        stream = client.responses.create(
            model="scripted-model", input="again", previous_response_id=first.id, stream=True
        )
        events = list(stream)
        retrieved = client.responses.retrieve(events[-1].response.id)  # type: ignore[union-attr]
    assert events[0].type == "response.created"
    assert events[-1].type == "response.completed"
    assert retrieved.previous_response_id == first.id
    assert retrieved.output_text == "Hello, world!"


def test_the_openai_sdk_raises_not_found_for_an_unknown_previous_response(
    make_app: AppFactory, live_server: Any
) -> None:
    server = live_server(make_app())
    with gpt(server.base_url) as client, pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model="scripted-model", input="hi", previous_response_id="resp_x")
    assert "not found or expired" in str(caught.value)
