"""The engine with --prompt-activations 8 or bf16 (EngineConfig.prompt_activations) on the real
SmolLM2: which tokens its steps mark coarse (a prompt's tokens before its last block, whatever
the chunking; none of a short prompt's), and the answers and guarantees that hold with them."""

from __future__ import annotations

import asyncio

import pytest
import torch
from gguf_blocks import T, random_tensor
from test_engine import collect

from modelhost.engine.engine import Engine, EngineConfig
from modelhost.engine.prompt_activations import (
    auto_bits,
    has_quantized_linears,
    parse_prompt_activations,
)
from modelhost.engine.runner import BF16_MIN_PROMPT_TOKENS
from modelhost.engine.sampling.sampling_params import SamplingParams
from modelhost.models.kernels import native
from modelhost.models.kernels.packed import PackedWeight, QuantLinear
from modelhost.models.loading.quant import amx_in_hardware

pytestmark = pytest.mark.skipif(native.kernels() is None, reason="no native kernels here")

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three primary colors are",
]


@pytest.fixture
def coarse_engine(smollm2):
    engine = Engine(smollm2, EngineConfig(batch=4, prompt_activations=8))
    yield engine
    engine.close()


@pytest.fixture
def bf16_engine(smollm2):
    engine = Engine(smollm2, EngineConfig(batch=4, prompt_activations="bf16"))
    yield engine
    engine.close()


def record_batches(
    engine: Engine, bf16: list[bool] | None = None
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Each step's (positions, coarse_rows) as the runner builds them (and into `bf16`, each
    step's coarse_bf16)."""
    seen: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    build = engine.runner.build_batch

    def recording(out):
        batch = build(out)
        seen.append((batch.positions.clone(), batch.coarse_rows))
        if bf16 is not None:
            bf16.append(batch.coarse_bf16)
        return batch

    engine.runner.build_batch = recording  # type: ignore[method-assign]
    return seen


async def test_a_chunked_prompts_tokens_before_its_last_block_are_coarse_and_generated_ones_never(
    smollm2,
):
    engine = Engine(smollm2, EngineConfig(max_num_batched_tokens=32, prompt_activations=8))
    try:
        seen = record_batches(engine)
        prompt = smollm2.tokenizer.encode("The history of the Roman Empire begins " * 10)
        tokens, _, last = await collect(engine, prompt, GREEDY)
    finally:
        engine.close()
    assert len(prompt) > 64  # three chunks or more
    coarse = [int(p) for positions, mask in seen if mask is not None for p in positions[mask]]
    block = engine.config.block_size
    assert sorted(coarse) == list(range((len(prompt) - 1) // block * block))
    assert len(tokens) == last.usage.completion_tokens == 16


async def test_sixteen_bit_prompts_mark_no_coarse_rows(smollm2):
    engine = Engine(smollm2, EngineConfig(prompt_activations=16))
    try:
        seen = record_batches(engine)
        await collect(engine, smollm2.tokenizer.encode("A good breakfast includes " * 8), GREEDY)
    finally:
        engine.close()
    assert seen and all(mask is None for _, mask in seen)


async def test_a_short_prompt_marks_no_coarse_rows(coarse_engine, smollm2):
    seen = record_batches(coarse_engine)
    prompt = smollm2.tokenizer.encode("The history of the Roman Empire begins " * 4)
    assert len(prompt) < 64
    await collect(coarse_engine, prompt, GREEDY)
    assert seen and all(mask is None for _, mask in seen)


async def test_a_cached_prompt_recomputes_its_last_block_at_16_bits_alone(coarse_engine, smollm2):
    # One kind of row in the step: its weights are read once (packed.py computes kinds apart).
    prompt = smollm2.tokenizer.encode("The history of the Roman Empire begins " * 10)
    await collect(coarse_engine, prompt, GREEDY)
    seen = record_batches(coarse_engine)
    _, _, last = await collect(coarse_engine, prompt, GREEDY)
    assert last.usage.cached_tokens > 0
    assert seen and all(mask is None for _, mask in seen)


async def test_a_one_token_prompt_answers_at_eight_bits_as_at_sixteen(coarse_engine, smollm2):
    # Its only token is its last, whose logits are read: no coarse row, the same tokens.
    prompt = smollm2.tokenizer.encode("The")[-1:]
    engine = Engine(smollm2, EngineConfig(batch=4, prompt_activations=16))
    try:
        fine, _, _ = await collect(engine, prompt, GREEDY)
    finally:
        engine.close()
    coarse, _, last = await collect(coarse_engine, prompt, GREEDY)
    assert coarse == fine
    assert last.usage.prompt_tokens == 1


async def test_with_eight_bit_prompts_a_cached_prompt_gives_its_cold_greedy_tokens(
    coarse_engine, smollm2
):
    prompt = smollm2.tokenizer.encode("The history of the Roman Empire begins " * 6)
    cold, _, _ = await collect(coarse_engine, prompt, GREEDY)
    warm, _, last = await collect(coarse_engine, prompt, GREEDY)
    assert last.usage.cached_tokens > 0
    assert warm == cold


async def test_with_eight_bit_prompts_rows_run_together_equal_each_run_alone(
    coarse_engine, smollm2
):
    prompts = [smollm2.tokenizer.encode(p) for p in PROMPTS]
    alone = [(await collect(coarse_engine, p, GREEDY))[0] for p in prompts]
    together = await asyncio.gather(*(collect(coarse_engine, p, GREEDY) for p in prompts))
    assert [tokens for tokens, _, _ in together] == alone


async def test_with_bf16_prompts_a_long_prompts_tokens_before_its_last_block_are_bf16_rows(
    bf16_engine, smollm2
):
    flags: list[bool] = []
    seen = record_batches(bf16_engine, flags)
    prompt = smollm2.tokenizer.encode("The history of the Roman Empire begins " * 80)
    assert len(prompt) >= BF16_MIN_PROMPT_TOKENS
    await collect(bf16_engine, prompt, GREEDY)
    marked = [(positions, mask) for positions, mask in seen if mask is not None]
    assert marked
    assert flags == [mask is not None for _, mask in seen]  # bf16 exactly where rows are marked
    block = bf16_engine.runner.block_size
    last_block = (len(prompt) - 1) // block * block
    coarse_positions = torch.cat([positions[mask] for positions, mask in marked])
    assert coarse_positions.tolist() == list(range(last_block))


async def test_with_bf16_prompts_a_prompt_under_512_tokens_marks_no_rows(bf16_engine, smollm2):
    seen = record_batches(bf16_engine)
    prompt = smollm2.tokenizer.encode("The history of the Roman Empire begins " * 20)
    assert 64 < len(prompt) < BF16_MIN_PROMPT_TOKENS
    await collect(bf16_engine, prompt, GREEDY)
    assert seen and all(mask is None for _, mask in seen)


async def test_with_bf16_prompts_a_cached_prompt_gives_its_cold_greedy_tokens(bf16_engine, smollm2):
    prompt = smollm2.tokenizer.encode("The history of the Roman Empire begins " * 80)
    cold, _, _ = await collect(bf16_engine, prompt, GREEDY)
    warm, _, last = await collect(bf16_engine, prompt, GREEDY)
    assert last.usage.cached_tokens > 0
    assert warm == cold


async def test_with_bf16_prompts_a_long_prompt_answers_as_at_sixteen_bits(bf16_engine, smollm2):
    prompt = smollm2.tokenizer.encode("The history of the Roman Empire begins " * 80)
    engine = Engine(smollm2, EngineConfig(batch=4, prompt_activations=16))
    try:
        fine, _, _ = await collect(engine, prompt, GREEDY)
    finally:
        engine.close()
    coarse, _, _ = await collect(bf16_engine, prompt, GREEDY)
    assert coarse == fine  # a repeated sentence: no near tie for bf16 to flip


def test_auto_takes_bf16_on_a_cpu_with_amx_for_packed_linears_from_a_hidden_size_of_512():
    assert auto_bits(576, quantized=True, packed=True, amx=True) == "bf16"  # SmolLM2
    assert auto_bits(2048, quantized=False, packed=True, amx=True) == "bf16"  # f16 weights
    assert auto_bits(256, quantized=True, packed=True, amx=True) == 16  # tiny test models
    assert auto_bits(2048, quantized=False, packed=False, amx=True) == 16  # PyTorch's linears
    assert auto_bits(2048, quantized=True, packed=True, amx=False) == 8


def test_auto_takes_8_bits_for_quantized_weights_from_a_hidden_size_of_1536():
    assert auto_bits(2048, quantized=True) == 8  # Llama 3.2 1B
    assert auto_bits(3072, quantized=True) == 8  # Llama 3.2 3B
    assert auto_bits(1536, quantized=True) == 8
    assert auto_bits(576, quantized=True) == 16  # SmolLM2 135M: measured slower at 8
    assert auto_bits(4096, quantized=False) == 16  # float weights: no integer products


@pytest.mark.parametrize(("qtype", "quantized"), [(T.Q4_K, True), (T.F16, False)])
def test_a_network_has_quantized_linears_where_a_linear_holds_gguf_levels(qtype, quantized):
    kernels = native.kernels()
    assert kernels is not None
    raw = random_tensor(qtype, 32, 256, 0)
    weight = PackedWeight.repack(kernels, int(qtype), raw.ctypes.data, 32, 256)
    network = torch.nn.Sequential(QuantLinear([weight], None))
    assert has_quantized_linears(network) is quantized


def test_prompt_activations_other_than_auto_8_16_or_bf16_are_refused():
    choices = [parse_prompt_activations(v) for v in ("auto", "8", "16", 8, "bf16")]
    assert choices == ["auto", 8, 16, 8, "bf16"]
    with pytest.raises(ValueError, match="auto, 8, 16 or bf16"):
        parse_prompt_activations("4")


def test_the_embedded_model_takes_bf16_prompts_with_amx_else_16_bits_and_says_so(smollm2):
    engine = Engine(smollm2, EngineConfig())
    try:
        assert engine.stats().prompt_activations == ("bf16" if amx_in_hardware() else 16)
    finally:
        engine.close()
    engine = Engine(smollm2, EngineConfig(prompt_activations=8))
    try:
        assert engine.stats().prompt_activations == 8
    finally:
        engine.close()
