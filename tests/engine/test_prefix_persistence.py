"""An engine with a disk prefix store: the prompts it has seen outlive it, and a new engine over
the same model serves their prefix from the store with the same greedy tokens as a cold prefill."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from modelhost.engine.engine import Engine, EngineConfig
from modelhost.engine.events import EngineEvent
from modelhost.engine.kv.prefix_persistence import block_bytes, fill_block, pool_bytes
from modelhost.engine.kv.prefix_store import chain_key
from modelhost.engine.sampling.sampling_params import SamplingParams
from modelhost.models.batch import KVCache
from modelhost.models.loaded import LoadedModel
from modelhost.residency.kv.kv_model_identity import prefix_store_opener
from modelhost.residency.kv.kv_store import KVDiskStore

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
KV_BYTES = 64 << 20  # a small pool: these tests need a few hundred blocks
BLOCK = 8  # the engine's block size: tokens a store file holds


def long_prompt(model: LoadedModel, words: int = 90) -> list[int]:
    text = " ".join(f"item {i} is {'red' if i % 3 else 'blue'}," for i in range(words))
    return model.tokenizer.encode(f"Remember this list: {text} Which item came first?")


def engine_over(model: LoadedModel, store: KVDiskStore | None) -> Engine:
    opener = prefix_store_opener(model, store) if store is not None else None
    return Engine(model, EngineConfig(batch=2, kv_cache_bytes=KV_BYTES), prefix_store=opener)


async def run(engine: Engine, prompt: list[int]) -> tuple[list[int], EngineEvent]:
    events = [event async for event in engine.submit(prompt, GREEDY)]
    return [token for event in events for token in event.token_ids], events[-1]


async def answer(
    model: LoadedModel, store: KVDiskStore | None, prompt: list[int]
) -> tuple[list[int], EngineEvent]:
    """`prompt`'s greedy tokens and last event from a new engine, closed after (which writes
    to `store` what its writer had not yet)."""
    engine = engine_over(model, store)
    try:
        return await run(engine, prompt)
    finally:
        engine.close()


@pytest.fixture
def store(tmp_path: Path) -> KVDiskStore:
    return KVDiskStore(tmp_path / "kv", budget_bytes=1 << 30)


async def test_a_new_engine_serves_a_seen_prompt_from_the_store_with_the_same_tokens(
    smollm2: LoadedModel, store: KVDiskStore
) -> None:
    prompt = long_prompt(smollm2)
    cold_tokens, _ = await answer(smollm2, None, prompt)
    first_tokens, first_last = await answer(smollm2, store, prompt)
    assert first_tokens == cold_tokens
    assert first_last.usage is not None and first_last.usage.cached_tokens == 0
    assert store.usage().files >= len(prompt) // 8 - 1

    tokens, last = await answer(smollm2, store, prompt)
    assert tokens == cold_tokens
    assert last.usage is not None
    assert last.usage.cached_tokens >= 0.95 * len(prompt)


async def test_a_prompt_sharing_only_a_prefix_reads_that_prefix_from_the_store(
    smollm2: LoadedModel, store: KVDiskStore
) -> None:
    prompt = long_prompt(smollm2)
    await answer(smollm2, store, prompt)
    other = prompt[:200] + smollm2.tokenizer.encode(" Which item came last?")
    cold_tokens, _ = await answer(smollm2, None, other)
    tokens, last = await answer(smollm2, store, other)
    assert tokens == cold_tokens
    assert last.usage is not None and last.usage.cached_tokens == 200


async def test_a_block_missing_midway_ends_the_restore_there_and_the_answer_is_unchanged(
    smollm2: LoadedModel, store: KVDiskStore
) -> None:
    prompt = long_prompt(smollm2)
    cold_tokens, _ = await answer(smollm2, store, prompt)
    keys, parent = [], None
    for start in range(0, 40 * BLOCK, BLOCK):
        parent = chain_key(parent, prompt[start : start + BLOCK])
        keys.append(parent)
    files = {path.stem: path for path in Path(store.root).rglob("*.kvb")}
    files[keys[30].hex()].unlink()
    tokens, last = await answer(smollm2, store, prompt)
    assert tokens == cold_tokens
    assert last.usage is not None and last.usage.cached_tokens == 30 * BLOCK
    assert all(files[key.hex()].exists() for key in keys[31:])  # never read, never removed


async def test_a_corrupted_block_file_is_ignored_and_removed_and_the_answer_is_unchanged(
    smollm2: LoadedModel, store: KVDiskStore
) -> None:
    prompt = long_prompt(smollm2)
    cold_tokens, _ = await answer(smollm2, store, prompt)
    corrupted = {}
    for path in Path(store.root).rglob("*.kvb"):  # a flipped byte in every block's payload
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
        corrupted[path] = bytes(data)
    tokens, last = await answer(smollm2, store, prompt)
    assert tokens == cold_tokens
    assert last.usage is not None and last.usage.cached_tokens == 0
    # The engine computed the blocks again and wrote them over the bad files.
    assert all(path.read_bytes() != data for path, data in corrupted.items())


async def test_another_model_never_reads_this_models_blocks(
    smollm2: LoadedModel, gemma3: LoadedModel, store: KVDiskStore
) -> None:
    prompt = long_prompt(smollm2, 40)
    await answer(smollm2, store, prompt)
    _, last = await answer(gemma3, store, prompt)
    assert last.usage is not None and last.usage.cached_tokens == 0
    assert {m.id for m in store.usage().models} == {smollm2.id, gemma3.id}


def test_a_block_lands_the_same_copied_as_bytes_or_as_tensors() -> None:
    def pools() -> KVCache:
        return KVCache.allocate(num_layers=3, num_slots=4 * BLOCK, num_kv_heads=2, head_dim=4,
                                dtype=torch.bfloat16, device=torch.device("cpu"),
                                block_size=BLOCK)  # fmt: skip

    source = pools()
    for pool in source.pools:
        pool.copy_(torch.randn(pool.shape))
    payload = memoryview(bytearray(block_bytes(source, 1)))
    as_bytes, as_tensors = pools(), pools()
    fill_block(as_bytes, 2, payload, pool_bytes(as_bytes))
    fill_block(as_tensors, 2, payload, None)  # as into a CUDA pool
    for copied, other, original in zip(as_bytes.pools, as_tensors.pools, source.pools, strict=True):
        assert torch.equal(copied, other)
        assert torch.equal(copied[2 * BLOCK : 3 * BLOCK], original[BLOCK : 2 * BLOCK])
        assert not copied[: 2 * BLOCK].any() and not copied[3 * BLOCK :].any()
