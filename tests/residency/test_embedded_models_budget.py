"""End to end with the two embedded chat models and a tiny one under a budget that fits two of
them (idle, and one of them serving a request): each new model drains the least recently used
idle one, never the one just used."""

from __future__ import annotations

import time

import openai
import pytest
from live_server import LiveServer

from modelhost.assembly import build_stage
from modelhost.models.loading.loader import load_model
from modelhost.residency.host import ResidencyHost
from modelhost.residency.inprocess import InProcessUnit, in_process_loader
from modelhost.residency.registry import ModelRegistry, ServingShape
from modelhost.residency.router import ModelRouter
from modelhost.residency.unit import claim_bytes
from modelhost.server.app import create_routed_app
from modelhost.server.settings import ServeSettings

pytestmark = pytest.mark.slow
SMOLLM2, GEMMA = "smollm2-135m-instruct", "gemma-3-270m"


def test_new_models_drain_the_least_recently_used_under_a_budget_for_two(
    smollm2, gemma3, models_dir, tmp_path
):
    # A 2,048-token context keeps each request's claim (working memory and a context of KV)
    # below what SmolLM2 holds idle, so the budget below separates the cases.
    shape = ServingShape(batch=2, context_length=2048)
    registry = ModelRegistry(
        [models_dir], home=tmp_path / "home", hf_hub=tmp_path / "hub", shape=shape
    )
    smollm2, gemma, tiny = (registry.get(m) for m in (SMOLLM2, GEMMA, "tiny-a"))
    assert smollm2 is not None and gemma is not None and tiny is not None
    # Room for Gemma serving a request beside a tiny model, never beside SmolLM2.
    gemma_busy = gemma.estimate_bytes + claim_bytes(gemma, 1)
    budget = gemma_busy + (smollm2.estimate_bytes + tiny.estimate_bytes) // 2
    assert tiny.estimate_bytes + claim_bytes(tiny, 1) <= budget - gemma.estimate_bytes
    settings = ServeSettings(context_length=2048)
    unloads: list[str] = []  # in the order their drains finished
    host: ResidencyHost[InProcessUnit] = ResidencyHost(
        budget_bytes=budget,
        source=registry.get,
        load=in_process_loader(load_model, lambda m: build_stage(m, settings, batch=2)),
        hold_s=0.0,
        publish=lambda name, payload: (
            unloads.append(payload["id"]) if name == "model.unload" else None
        ),
    )
    router = ModelRouter(host, registry, current=SMOLLM2)

    def resident() -> set[str]:
        return {m.id for m in host.resident()}

    with LiveServer(create_routed_app(router, settings)) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)

        def ask(model: str) -> str:
            reply = client.completions.create(model=model, prompt="The sky is", max_tokens=2)
            return reply.model

        assert ask(SMOLLM2) == SMOLLM2 and resident() == {SMOLLM2}
        assert ask(GEMMA) == GEMMA and resident() == {GEMMA}  # SmolLM2 drained for Gemma
        assert ask("tiny-a") == "tiny-a" and resident() == {GEMMA, "tiny-a"}  # two fit
        assert ask(GEMMA) == GEMMA  # Gemma is now the most recently used
        # The lease ends just after the response is written; planning under a live lease
        # would (rightly) choose to wait for Gemma instead of naming a victim.
        deadline = time.monotonic() + 10
        while any(m.leases for m in host.resident()) and time.monotonic() < deadline:
            time.sleep(0.01)
        plan = host.plan(SMOLLM2)
        assert plan.evict[0] == "tiny-a"  # the least recently used goes first
        assert ask(SMOLLM2) == SMOLLM2
        assert resident() == {SMOLLM2, GEMMA} - set(plan.evict)
        assert unloads[1:] and set(unloads[1:]) == set(plan.evict)
        client.close()
    assert host.resident() == []
