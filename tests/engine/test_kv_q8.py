"""The 8-bit KV cache (--kv-cache q8): its answers, its bytes, and its blocks kept apart."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from modelhost.engine.engine import Engine, EngineConfig
from modelhost.engine.events import EngineEvent
from modelhost.engine.kv.kv_format import KVFormat, kv_token_bytes
from modelhost.engine.sampling.sampling_params import SamplingParams
from modelhost.models import kv_q8
from modelhost.models.kernels import native
from modelhost.models.loaded import LoadedModel
from modelhost.residency.kv.kv_model_identity import prefix_store_opener
from modelhost.residency.kv.kv_store import KVDiskStore
from modelhost.residency.registry import ServingShape

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
KV_BYTES = 16 << 20


def engine_over(model: LoadedModel, kv_cache: KVFormat, store: KVDiskStore | None = None) -> Engine:
    opener = prefix_store_opener(model, store) if store is not None else None
    config = EngineConfig(batch=2, kv_cache_bytes=KV_BYTES, kv_cache=kv_cache, speculate="none")
    return Engine(model, config, prefix_store=opener)


async def answer(engine: Engine, prompt: list[int]) -> tuple[list[int], EngineEvent]:
    try:
        events = [event async for event in engine.submit(prompt, GREEDY)]
    finally:
        engine.close()
    return [token for event in events for token in event.token_ids], events[-1]


def remembered_list(model: LoadedModel) -> list[int]:
    text = " ".join(f"item {i} is {'red' if i % 3 else 'blue'}," for i in range(40))
    return model.tokenizer.encode(f"Remember this list: {text} Which item came first?")


def test_q8_slots_read_back_within_half_a_step_of_their_groups_scale() -> None:
    torch.manual_seed(0)
    kv = torch.randn(5, 2, 3, 64) * 4
    back = kv_q8.dequantize(kv_q8.quantize(kv), 64)
    step = kv.unflatten(-1, (2, 32)).abs().amax(dim=-1, keepdim=True) / 127
    error = (back - kv).unflatten(-1, (2, 32)).abs()
    # Half a step, and a little more where the bf16 scale rounded down clamps the largest.
    assert torch.all(error <= step * 0.51 + 1e-6)


async def test_greedy_tokens_from_an_8_bit_cache_match_the_16_bit_ones(
    smollm2: LoadedModel,
) -> None:
    prompt = remembered_list(smollm2)
    sixteen, _ = await answer(engine_over(smollm2, "f16"), prompt)
    eight, _ = await answer(engine_over(smollm2, "q8"), prompt)
    assert eight == sixteen


# A short prompt attends natively over the q8 pool too; a long one through PyTorch's path.
@pytest.mark.parametrize("long", [False, True])
async def test_greedy_tokens_are_the_same_whether_the_kernels_or_pytorch_read_the_8_bit_cache(
    smollm2: LoadedModel, monkeypatch: pytest.MonkeyPatch, long: bool
) -> None:
    short = smollm2.tokenizer.encode("Name three colours of the rainbow and say why it forms.")
    prompt = remembered_list(smollm2) if long else short
    natively, _ = await answer(engine_over(smollm2, "q8"), prompt)
    readable = native.cache_readable
    monkeypatch.setattr(
        native, "cache_readable", lambda pool: readable(pool) and pool.dtype != torch.int8
    )
    through_pytorch, _ = await answer(engine_over(smollm2, "q8"), prompt)
    assert natively == through_pytorch


def test_a_token_costs_about_half_the_bytes_in_an_8_bit_cache(smollm2: LoadedModel) -> None:
    config = smollm2.config
    sixteen, eight = kv_token_bytes(config, 2, "f16"), kv_token_bytes(config, 2, "q8")
    scales = 2 * (config.head_dim // 32)  # an bf16 scale for each group of 32
    assert eight == sixteen // 2 + 2 * config.num_layers * config.num_kv_heads * scales
    assert eight <= 0.55 * sixteen


def test_the_same_pool_bytes_hold_about_twice_the_blocks_in_8_bits(
    smollm2: LoadedModel,
) -> None:
    sixteen = EngineConfig(kv_cache_bytes=KV_BYTES).num_blocks(smollm2, 2048)
    eight = EngineConfig(kv_cache_bytes=KV_BYTES, kv_cache="q8").num_blocks(smollm2, 2048)
    assert 1.85 * sixteen <= eight <= 2 * sixteen


def test_the_registry_counts_a_context_of_8_bit_kv_at_about_half(smollm2: LoadedModel) -> None:
    from modelhost.residency.registry import serving_bytes

    config = smollm2.config
    sixteen = serving_bytes(config, 10**8, ServingShape(batch=2))
    eight = serving_bytes(config, 10**8, ServingShape(batch=2, kv_cache="q8"))
    assert eight.kv_row <= 0.55 * sixteen.kv_row


@pytest.mark.parametrize(("writer", "reader"), [("f16", "q8"), ("q8", "f16")])
async def test_the_store_never_serves_one_formats_blocks_to_the_other(
    smollm2: LoadedModel, tmp_path: Path, writer: KVFormat, reader: KVFormat
) -> None:
    store = KVDiskStore(tmp_path / "kv", budget_bytes=1 << 30)
    prompt = remembered_list(smollm2)
    await answer(engine_over(smollm2, writer, store), prompt)
    assert store.usage().files > 0
    _, other = await answer(engine_over(smollm2, reader, store), prompt)
    assert other.usage is not None and other.usage.cached_tokens == 0
    _, same = await answer(engine_over(smollm2, writer, store), prompt)
    assert same.usage is not None and same.usage.cached_tokens >= 0.9 * len(prompt)
