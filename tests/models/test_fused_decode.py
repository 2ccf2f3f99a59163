"""The one-call decode path (models/fused_decode.py) against the module-by-module one."""

from __future__ import annotations

import asyncio

import pytest

from modelhost.engine.engine import Engine, EngineConfig
from modelhost.engine.sampling_params import SamplingParams
from modelhost.models import native
from modelhost.models.loaded import LoadedModel

pytestmark = pytest.mark.skipif(native.kernels() is None, reason="no native kernels here")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


def greedy_with_logprobs(model: LoadedModel, fused: bool) -> list[list[tuple[int, float]]]:
    """Each prompt's 24 greedy tokens with their logprobs, the prompts decoded together."""
    model.network.fuse_decode = fused

    async def one(engine: Engine, prompt: str) -> list[tuple[int, float]]:
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
        tokens = []
        async for event in engine.submit(model.tokenizer.encode(prompt), params):
            tokens += [(lp.token_id, lp.logprob) for lp in event.logprobs or []]
        return tokens

    async def run() -> list[list[tuple[int, float]]]:
        engine = Engine(model, EngineConfig(block_size=4))  # many block crossings
        try:
            return list(await asyncio.gather(*(one(engine, p) for p in PROMPTS)))
        finally:
            engine.close()

    try:
        return asyncio.run(run())
    finally:
        model.network.fuse_decode = True


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_fused_decode_steps_give_the_module_path_tokens_and_logprobs_exactly(name, request):
    model = request.getfixturevalue(name)
    assert model.network.fused_decode() is not None  # every layer runs natively
    fused = greedy_with_logprobs(model, fused=True)
    assert all(len(tokens) == 24 for tokens in fused)
    assert fused == greedy_with_logprobs(model, fused=False)
