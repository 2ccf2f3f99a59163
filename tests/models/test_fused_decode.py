"""The one-call decode path (models/kernels/fused_decode.py) against the module-by-module one."""

from __future__ import annotations

import asyncio

import pytest

from modelhost.engine.engine import Engine, EngineConfig, RequestStream
from modelhost.engine.sampling.sampling_params import SamplingParams
from modelhost.models.kernels import native
from modelhost.models.loaded import LoadedModel

pytestmark = pytest.mark.skipif(native.kernels() is None, reason="no native kernels here")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


def greedy_with_logprobs(model: LoadedModel, fused: bool) -> list[list[tuple[int, float]]]:
    """Each prompt's 24 greedy tokens with their logprobs, the prompts decoded together."""
    model.network.fuse_decode = fused

    async def collect(stream: RequestStream) -> list[tuple[int, float]]:
        tokens = []
        async for event in stream:
            tokens += [(lp.token_id, lp.logprob) for lp in event.logprobs or []]
        return tokens

    async def run() -> list[list[tuple[int, float]]]:
        engine = Engine(model, EngineConfig(block_size=4))  # many block crossings
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
        try:
            # One unit: admitted and prefilled together on every run, so that both paths
            # decode the same batches.
            streams = engine.submit_many([(model.tokenizer.encode(p), params) for p in PROMPTS])
            return list(await asyncio.gather(*(collect(stream) for stream in streams)))
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
