"""End to end: two tiny real models behind one port, a budget that holds only one, and the
OpenAI SDK as the client. The second model evicts the first; a stream keeps its model."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from live_server import LiveServer

from modelhost.assembly import build_stage
from modelhost.models.loading.loader import load_model
from modelhost.residency.host import ResidencyHost
from modelhost.residency.inprocess import InProcessUnit, in_process_loader
from modelhost.residency.registry import ModelRegistry, ServingShape
from modelhost.residency.router import ModelRouter
from modelhost.server.app import create_routed_app
from modelhost.server.settings import ServeSettings

pytestmark = pytest.mark.slow
SHAPE = ServingShape(batch=2)


@pytest.fixture
def served(models_dir, tmp_path) -> Iterator[dict[str, Any]]:
    registry = ModelRegistry(
        [models_dir], home=tmp_path / "home", hf_hub=tmp_path / "hub", embedded=False, shape=SHAPE
    )
    estimates = [entry.estimate_bytes for entry in registry.entries()]
    settings = ServeSettings()
    events: list[tuple[str, dict[str, Any]]] = []
    host: ResidencyHost[InProcessUnit] = ResidencyHost(
        budget_bytes=max(estimates) * 3 // 2,  # room for one model, never two
        source=registry.get,
        load=in_process_loader(load_model, lambda m: build_stage(m, settings, batch=2)),
        publish=lambda name, payload: events.append((name, payload)),
    )
    router = ModelRouter(host, registry, current="tiny-a")
    with LiveServer(create_routed_app(router, settings)) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        yield {"client": client, "host": host, "events": events, "url": server.base_url}
        client.close()
    assert host.resident() == []  # shutdown drained every model


def resident_ids(host: ResidencyHost[InProcessUnit]) -> list[str]:
    return [m.id for m in host.resident()]


def ask(client: openai.OpenAI, model: str) -> str:
    """The id of the model that answered."""
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert reply.choices[0].finish_reason in ("stop", "length")
    return reply.model


def test_a_second_model_evicts_the_first_when_the_budget_holds_one(served):
    client, host = served["client"], served["host"]
    assert ask(client, "tiny-a") == "tiny-a"
    assert resident_ids(host) == ["tiny-a"]
    assert ask(client, "tiny-b") == "tiny-b"
    assert resident_ids(host) == ["tiny-b"]
    listed = {m.id: m.model_extra for m in client.models.list().data}
    assert listed["tiny-a"]["current"] and not listed["tiny-a"]["resident"]
    assert listed["tiny-b"]["resident"] and not listed["tiny-b"]["current"]
    models = httpx.get(f"{served['url']}/stats").json()["models"]
    [row] = models["resident"]
    assert row["id"] == "tiny-b" and 0 < models["resident_bytes"] <= models["budget_bytes"]
    assert ask(client, "gpt-4") == "tiny-a"  # not a local id: the current model answers
    assert resident_ids(host) == ["tiny-a"]


def test_a_streaming_response_keeps_its_model_until_the_body_ends(served):
    client, events = served["client"], served["events"]
    answers: list[str] = []
    stream = client.chat.completions.create(
        model="tiny-a",
        messages=[{"role": "user", "content": "count"}],
        max_tokens=400,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    other = threading.Thread(target=lambda: answers.append(ask(client, "tiny-b")))
    other.start()
    time.sleep(0.5)
    loads = [p["id"] for name, p in events if name == "model.load" and p["phase"] == "started"]
    assert loads == ["tiny-a"] and not answers  # tiny-b waits: tiny-a is still streaming
    rest = list(chunks)
    assert rest[-1].choices[0].finish_reason == "length"
    other.join(timeout=60)
    assert answers == ["tiny-b"] and resident_ids(served["host"]) == ["tiny-b"]
