"""Prompt tokens attended natively over the paged keys (networks/layers.py) against SDPA over the
gathered context, the path longer contexts and machines without the kernels take.

fp32 weights and KV (`quantize="none"`): over an fp16 pool, a key that moves by an ulp of fp32
can round to the next fp16, and the two paths' summation orders then drift by ~1e-2.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from prompt_logits import prompt_logits

from modelhost.engine.engine import Engine, EngineConfig, RequestStream
from modelhost.engine.sampling.sampling_params import SamplingParams
from modelhost.models.kernels import native
from modelhost.models.loaded import LoadedModel
from modelhost.models.loading.loader import load_model
from modelhost.models.networks import layers

pytestmark = pytest.mark.skipif(native.kernels() is None, reason="no native kernels here")

# As tests/models/test_parity.py's against transformers (observed ~8e-5 apart, both models).
TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def smollm2_fp32() -> LoadedModel:
    return load_model("smollm2-135m-instruct", quantize="none")


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "gemma-3-270m"])
def test_a_prompts_logits_attended_natively_match_sdpas(name, monkeypatch):
    model = load_model(name, quantize="none")
    prompt = model.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 8)
    attended_natively = prompt_logits(model, prompt)
    monkeypatch.setattr(layers, "NATIVE_PROMPT_CONTEXT", 0)
    assert torch.allclose(attended_natively, prompt_logits(model, prompt), atol=TOLERANCE, rtol=0)


def first_tokens(model: LoadedModel, prompts: list[list[int]]) -> list[list[tuple[int, float]]]:
    """Each prompt's 4 greedy tokens with logprobs, the prompts admitted and prefilled in one
    step of several rows (different lengths, small blocks)."""

    async def collect(stream: RequestStream) -> list[tuple[int, float]]:
        return [(lp.token_id, lp.logprob) async for e in stream for lp in e.logprobs or []]

    async def run() -> list[list[tuple[int, float]]]:
        engine = Engine(model, EngineConfig(block_size=4))
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
        try:
            streams = engine.submit_many([(prompt, params) for prompt in prompts])
            return list(await asyncio.gather(*(collect(stream) for stream in streams)))
        finally:
            engine.close()

    return asyncio.run(run())


def test_rows_of_one_prompt_step_attend_to_their_own_keys_only(smollm2_fp32, monkeypatch):
    texts = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a land"]
    prompts = [smollm2_fp32.tokenizer.encode(text) for text in texts]
    attended_natively = first_tokens(smollm2_fp32, prompts)
    monkeypatch.setattr(layers, "NATIVE_PROMPT_CONTEXT", 0)
    with_sdpa = first_tokens(smollm2_fp32, prompts)
    for ours, theirs in zip(attended_natively, with_sdpa, strict=True):
        assert [token for token, _ in ours] == [token for token, _ in theirs]
        assert [lp for _, lp in ours] == pytest.approx([lp for _, lp in theirs], abs=1e-4)
