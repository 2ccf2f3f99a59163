"""End to end: a Qwen3-MoE-shaped GGUF (tiny, random, Q8_0 experts, SmolLM2's tokenizer) found
in a models folder and served through every protocol, with the official SDKs as clients."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from live_server import LiveServer
from tiny_gguf import write_gguf_from_hf
from tiny_models import make_tiny_checkpoint

from modelhost.assembly import build_stage
from modelhost.models.loaded import LoadedModel
from modelhost.models.loading.loader import load_model
from modelhost.residency.host import ResidencyHost
from modelhost.residency.inprocess import InProcessUnit, in_process_loader
from modelhost.residency.registry import ModelRegistry, ServingShape
from modelhost.residency.router import ModelRouter
from modelhost.server.app import create_routed_app
from modelhost.server.settings import ServeSettings

pytestmark = pytest.mark.slow
MODEL = "tiny-qwen3moe"
ASK: list[Any] = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def served(smollm2: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("moe")
    checkpoint = make_tiny_checkpoint(root / "checkpoint", "qwen3_moe", smollm2)
    folder = root / "models"
    folder.mkdir()
    write_gguf_from_hf(checkpoint, folder / f"{MODEL}.gguf", "Q8_0")
    registry = ModelRegistry(
        [folder], home=root / "home", hf_hub=root / "hub", embedded=False, shape=ServingShape(2)
    )
    settings = ServeSettings()
    host: ResidencyHost[InProcessUnit] = ResidencyHost(
        budget_bytes=1 << 30,
        source=registry.get,
        load=in_process_loader(load_model, lambda m: build_stage(m, settings, batch=2)),
        publish=lambda name, payload: None,
    )
    router = ModelRouter(host, registry, current=MODEL)
    with LiveServer(create_routed_app(router, settings)) as server:
        yield server.base_url
    assert host.resident() == []


def gpt(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_openai_chat_answers_and_streams_the_same_greedy_text(served: str) -> None:
    with gpt(served) as client:
        reply = client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=8, temperature=0
        )
        stream = client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=8, temperature=0, stream=True
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        listed = [m.id for m in client.models.list().data]
    assert MODEL in listed
    assert reply.model == MODEL
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage is not None and reply.usage.completion_tokens > 0
    assert streamed == reply.choices[0].message.content


def test_openai_completions_and_responses_answer(served: str) -> None:
    with gpt(served) as client:
        completion = client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0
        )
        response = client.responses.create(
            model=MODEL, input="Say hello.", max_output_tokens=6, temperature=0
        )
    assert completion.choices[0].finish_reason in ("stop", "length")
    assert completion.usage is not None and completion.usage.completion_tokens > 0
    assert response.status in ("completed", "incomplete")  # incomplete: max_output_tokens
    assert response.output_text == "".join(
        part.text
        for item in response.output
        if item.type == "message"
        for part in item.content
        if part.type == "output_text"
    )
    assert response.usage is not None and response.usage.output_tokens > 0


def test_anthropic_messages_answer_and_stream(served: str) -> None:
    with anthropic.Anthropic(
        base_url=served, api_key="unused", max_retries=0, timeout=120
    ) as client:
        message = client.messages.create(
            model=MODEL, max_tokens=8, messages=ASK, extra_body={"temperature": 0}
        )
        with client.messages.stream(
            model=MODEL, max_tokens=8, messages=ASK, extra_body={"temperature": 0}
        ) as stream:
            streamed = "".join(stream.text_stream)
    assert message.model == MODEL
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.output_tokens > 0
    assert streamed == "".join(b.text for b in message.content if b.type == "text")


def test_decisions_and_systemone_read_probabilities_that_sum_to_one(served: str) -> None:
    choice = {
        "type": "choice",
        "name": "team",
        "instructions": "Which team handles it?",
        "choices": [{"value": "billing"}, {"value": "shipping"}],
    }
    body = {"model": MODEL, "input": "I was charged twice.", "questions": [choice]}
    decided = httpx.post(f"{served}/v1/decisions", json=body, timeout=120)
    assert decided.status_code == 200, decided.text
    [answer] = decided.json()["answers"]
    assert math.isclose(sum(p["probability"] for p in answer["probabilities"]), 1.0, rel_tol=1e-6)
    question = {"urgent": {"type": "noul", "instructions": "Needs a reply within the hour?"}}
    system_one = {"model": MODEL, "state": "I was charged twice.", "questions": question}
    read = httpx.post(f"{served}/v1/systemone", json=system_one, timeout=120)
    assert read.status_code == 200, read.text
    assert 0.0 <= read.json()["answers"]["urgent"]["noul"] <= 1.0
