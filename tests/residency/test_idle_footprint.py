"""An idle resident model costs about its weights: the registry's estimate and the unit's own
measurement both, after loading and after serving a request (its KV pool grows with use and
gives memory back once idle, instead of 1 GiB zeroed at load)."""

from __future__ import annotations

import asyncio
import os

import pytest

from modelhost.assembly import build_stage
from modelhost.engine.kv.kv_pool_size import IDLE_KV_BYTES
from modelhost.engine.sampling.sampling_params import SamplingParams
from modelhost.residency.inprocess import InProcessUnit
from modelhost.residency.registry import ModelRegistry
from modelhost.residency.workers.supervisor import rss_bytes
from modelhost.server.settings import ServeSettings

CHAT_MODELS = {"smollm2-135m-instruct": "smollm2", "gemma-3-270m": "gemma3"}


@pytest.mark.parametrize("model_id", sorted(CHAT_MODELS))
def test_an_embedded_models_estimate_is_its_weights_and_the_cache_it_keeps_idle(model_id, tmp_path):
    entry = ModelRegistry(home=tmp_path / "home", hf_hub=tmp_path / "hub").get(model_id)
    assert entry is not None
    assert entry.weights_bytes < entry.estimate_bytes <= entry.weights_bytes + IDLE_KV_BYTES
    assert entry.kv_pool_bytes >= 1 << 30  # what busy rows may still grow the pool to


@pytest.mark.parametrize("model_id", sorted(CHAT_MODELS))
async def test_an_embedded_model_holds_about_its_weights_after_load_and_after_a_request(
    model_id, request
):
    model = request.getfixturevalue(CHAT_MODELS[model_id])
    before = rss_bytes(os.getpid())
    unit = InProcessUnit(build_stage(model, ServeSettings(), batch=2))
    try:
        after_load = rss_bytes(os.getpid())
        assert before is not None and after_load is not None
        assert after_load - before < 64 << 20  # the pool is reserved, not zeroed (was 1 GiB)
        assert unit.measured_bytes() == model.weights_bytes
        engine = unit.stage.engine  # type: ignore[attr-defined]
        prompt = model.tokenizer.encode("Tell me about the sea. " * 400)  # ~2,400 tokens
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        busiest = 0
        async for _ in engine.submit(prompt, params):
            busiest = max(busiest, unit.measured_bytes() or 0)
        assert busiest - model.weights_bytes > IDLE_KV_BYTES  # the pool grew for the row
        for _ in range(500):  # the engine gives back once its loop finds itself idle
            if (unit.measured_bytes() or 0) - model.weights_bytes <= IDLE_KV_BYTES:
                break
            await asyncio.sleep(0.01)
        assert (unit.measured_bytes() or 0) - model.weights_bytes <= IDLE_KV_BYTES
    finally:
        await unit.close()
