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

kernels = native.kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="no native kernels here")

# As tests/models/test_parity.py's against transformers (observed ~8e-5 apart, both models).
TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def smollm2_fp32() -> LoadedModel:
    return load_model("smollm2-135m-instruct", quantize="none")


def with_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every prompt token attends through SDPA over the gathered context from here on."""
    monkeypatch.setattr(layers, "NATIVE_PROMPT_CONTEXT", 0)
    monkeypatch.setattr(layers.Attention, "_tiles_prompt", lambda *args: False)


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "gemma-3-270m"])
def test_a_prompts_logits_attended_natively_match_sdpas(name, monkeypatch):
    model = load_model(name, quantize="none")
    prompt = model.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 8)
    attended_natively = prompt_logits(model, prompt)
    with_sdpa(monkeypatch)
    assert torch.allclose(attended_natively, prompt_logits(model, prompt), atol=TOLERANCE, rtol=0)


def test_gemmas_sliding_layers_tiled_attend_within_their_window_as_one_token_at_a_time(
    monkeypatch,
):
    # Against the kernel every decode step runs (one token's heads at a time, within the
    # window): at 640 tokens SDPA's order of sums drifts from both by ~1e-3 on its own.
    model = load_model("gemma-3-270m", quantize="none")
    window = model.config.sliding_window
    assert window is not None
    prompt = model.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 64)
    assert len(prompt) > window + 64  # later tokens' windows leave the first keys behind
    tiled = prompt_logits(model, prompt)
    monkeypatch.setattr(layers, "NATIVE_PROMPT_CONTEXT", 1 << 20)  # any context
    monkeypatch.setattr(layers.Attention, "_tiles_prompt", lambda *args: False)
    assert torch.allclose(tiled, prompt_logits(model, prompt), atol=TOLERANCE, rtol=0)


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
    with_sdpa(monkeypatch)
    through_sdpa = first_tokens(smollm2_fp32, prompts)
    for ours, theirs in zip(attended_natively, through_sdpa, strict=True):
        assert [token for token, _ in ours] == [token for token, _ in theirs]
        assert [lp for _, lp in ours] == pytest.approx([lp for _, lp in theirs], abs=1e-4)


def a_prompt_step(heads: int, kv_heads: int, dim: int, cached: torch.dtype):
    """A step of two prompts (37 tokens from position 0; 50 from position 20, its first 20 keys
    already in the pool) and a decode row at position 44, over scattered blocks of 4: the
    arguments of paged_attention and prompt_attention, and which tokens are 8-bit prompt rows
    (each prompt's tokens but its last)."""
    torch.manual_seed(0)
    block_size, blocks_per_row = 4, 20
    spans = [(0, 37), (20, 50), (44, 1)]  # (first position, tokens)
    pool = torch.zeros((1 + 3 * blocks_per_row) * block_size, 2, kv_heads, dim, dtype=cached)
    pool[block_size:] = torch.randn(pool.shape[0] - block_size, 2, kv_heads, dim).to(cached)
    tables = [[1 + r + 3 * j for j in range(blocks_per_row)] for r in range(3)]
    positions, token_tables, tiled = [], [], []
    for r, (first, count) in enumerate(spans):
        positions += range(first, first + count)
        token_tables += [tables[r]] * count
        tiled += [True] * (count - 1) + [False]
    positions_t, blocks = torch.tensor(positions), torch.tensor(token_tables)
    slots = blocks[torch.arange(len(positions)), positions_t // block_size] * block_size
    slots += positions_t % block_size
    qkv = torch.randn(len(positions), (heads + 2 * kv_heads) * dim)
    cos, sin = layers.Rotary(dim, 10_000.0).cos_sin(positions_t, torch.float32)
    return qkv, (cos, sin), pool, slots, blocks, block_size, positions_t, torch.tensor(tiled)


# Query heads per KV head: 3 (SmolLM2; tiles of 5 tokens), 4 (Llama 3.2 1B, Gemma 3 270M; 4
# tokens), 1. Windows: none, inside a block of 16 keys, a block's width, wider than a tile.
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(6, 2, 64), (8, 2, 32), (2, 2, 128)])
@pytest.mark.parametrize("cached", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [0, 5, 16, 21])
@pytest.mark.parametrize("softcap", [0.0, 2.0])
def test_tiled_prompt_attention_matches_attention_one_token_at_a_time(
    heads, kv_heads, dim, cached, window, softcap
):
    assert kernels is not None
    qkv, rope, pool, slots, blocks, block_size, positions, tiled = a_prompt_step(
        heads, kv_heads, dim, cached
    )
    paged_pool, tiled_pool = pool.clone(), pool.clone()
    one_at_a_time = kernels.paged_attention(
        qkv.clone(), heads, kv_heads, None, rope, paged_pool, slots, blocks, block_size,
        positions, window, 0.125, softcap,
    )  # fmt: skip
    got = kernels.prompt_attention(
        qkv.clone(), heads, kv_heads, None, rope, tiled_pool, slots, blocks, block_size,
        positions, tiled, window, 0.125, softcap,
    )  # fmt: skip
    assert torch.allclose(got[tiled], one_at_a_time[tiled], atol=1e-5, rtol=0)
    # A prompt's last token and the decode row attend as they would in any other step.
    assert torch.equal(got[~tiled], one_at_a_time[~tiled])
    assert torch.equal(tiled_pool, paged_pool)  # the step's keys and values stored alike


@pytest.mark.parametrize("window", [0, 21])
def test_a_prompts_tiled_results_do_not_depend_on_where_its_chunks_end(window):
    assert kernels is not None
    heads, kv_heads, dim = 8, 2, 32
    qkv, rope, pool, slots, blocks, block_size, positions, tiled = a_prompt_step(
        heads, kv_heads, dim, torch.float16
    )
    first = slice(0, 36)  # the first prompt's tokens but its last, tiled in one step
    whole = kernels.prompt_attention(
        qkv[first].clone(), heads, kv_heads, None, (rope[0][first], rope[1][first]),
        pool.clone(), slots[first], blocks[first], block_size, positions[first],
        tiled[first], window, 0.125,
    )  # fmt: skip
    chunked_pool = pool.clone()
    parts = []
    for chunk in (slice(0, 13), slice(13, 30), slice(30, 36)):  # ends inside blocks of 4 and 16
        part = kernels.prompt_attention(
            qkv[chunk].clone(), heads, kv_heads, None, (rope[0][chunk], rope[1][chunk]),
            chunked_pool, slots[chunk], blocks[chunk], block_size, positions[chunk],
            tiled[chunk], window, 0.125,
        )  # fmt: skip
        parts.append(part)
    assert torch.equal(torch.cat(parts), whole)
