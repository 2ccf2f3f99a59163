"""A KV pool that grows with use: blocks are committed as rows need them, lowest ids first, and
the free tail's memory goes back (it reads as zeros afterwards)."""

from __future__ import annotations

import asyncio
import tracemalloc

import torch

from modelhost.engine.engine import Engine, EngineConfig
from modelhost.engine.kv.block_manager import BlockManager
from modelhost.engine.kv.kv_memory import PAGE_BYTES, ReservedPools
from modelhost.engine.sampling.sampling_params import SamplingParams
from modelhost.engine.sequence import Sequence
from modelhost.residency.workers.supervisor import rss_bytes

BS = 4


def make_seq(seq_id: int, num_tokens: int, first: int = 1) -> Sequence:
    tokens = list(range(first, first + num_tokens))
    return Sequence.from_prompt(seq_id, tokens, SamplingParams())


def compute_all(bm: BlockManager, seq: Sequence) -> None:
    bm.allocate_prompt(seq)
    bm.append_slots(seq, seq.num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.commit_full_blocks(seq)
    bm.check_invariants()


def test_a_growing_pool_commits_no_block_until_a_row_needs_one() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS, grows=True)
    assert bm.num_committed == 0
    assert bm.num_free_blocks == 16  # every block may still be taken
    bm.check_invariants()


def test_a_growing_pool_hands_out_the_lowest_uncommitted_ids_in_order() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS, grows=True)
    first, second = make_seq(1, 9), make_seq(2, 5, first=100)
    compute_all(bm, first)
    compute_all(bm, second)
    assert first.block_table == [0, 1, 2]
    assert second.block_table == [3, 4]
    assert bm.num_committed == 5


def test_a_growing_pool_reuses_freed_blocks_that_cache_nothing_before_committing_new_ones() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS, grows=True)
    first = make_seq(1, 9)  # two full blocks (cached once freed) and a partial one
    compute_all(bm, first)
    bm.free(first)
    second = make_seq(2, 11, first=100)  # no prefix hit: three blocks
    compute_all(bm, second)
    assert second.block_table == [2, 3, 4]  # the partial block, then growth
    assert bm.num_committed == 5
    bm.check_invariants()


def test_a_growing_pool_grows_before_it_evicts_a_cached_prefix() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS, grows=True)
    first = make_seq(1, 9)
    compute_all(bm, first)
    bm.free(first)
    compute_all(bm, make_seq(2, 11, first=100))
    again = make_seq(3, 9)
    assert bm.allocate_prompt(again) == 2 * BS  # the first prompt's full blocks are still cached
    bm.check_invariants()


def test_a_full_growing_pool_evicts_the_least_recently_freed_cached_block() -> None:
    bm = BlockManager(num_blocks=3, block_size=BS, grows=True)
    first = make_seq(1, 9)
    compute_all(bm, first)
    bm.free(first)
    second = make_seq(2, 11, first=100)
    compute_all(bm, second)
    assert bm.num_committed == 3
    assert sorted(second.block_table) == [0, 1, 2]
    assert bm.allocate_prompt(make_seq(3, 9)) == 0  # the first prompt's blocks were taken
    bm.check_invariants()


def test_release_tail_uncommits_free_blocks_above_the_highest_block_in_use() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS, grows=True)
    low, high = make_seq(1, 8), make_seq(2, 8, first=100)
    compute_all(bm, low)
    compute_all(bm, high)
    bm.free(high)
    assert bm.release_tail() == 2  # blocks 2 and 3 go back; 0 and 1 are in use
    assert bm.num_committed == 2
    assert bm.release_tail() is None  # nothing more to give back
    bm.check_invariants()


def test_release_tail_keeps_the_blocks_asked_for_and_forgets_the_prefixes_it_drops() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS, grows=True)
    seq = make_seq(1, 17)
    compute_all(bm, seq)
    bm.free(seq)
    assert bm.release_tail(keep_blocks=2) == 2
    again = make_seq(2, 17)
    assert bm.allocate_prompt(again) == 2 * BS  # the kept blocks still serve the prefix
    bm.check_invariants()


def test_a_fixed_pool_is_committed_whole_and_never_shrinks() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = make_seq(1, 9)
    compute_all(bm, seq)
    bm.free(seq)
    assert bm.num_committed == 8
    assert bm.release_tail() is None


def test_a_reserved_pool_reads_zero_and_reads_zero_again_after_giving_pages_back() -> None:
    slot_shape = (2, 4, 64)  # 1 KiB a slot in fp16
    pools = ReservedPools(2, 64, slot_shape, torch.float16)
    assert all(not pool.any() for pool in pools.pools)
    for pool in pools.pools:
        pool.fill_(1.0)
    given = pools.release_from(PAGE_BYTES // 1024)  # keep the first page
    assert given > 0
    first_page = PAGE_BYTES // 1024
    for pool in pools.pools:
        assert bool((pool[:first_page] == 1).all())
        assert not pool[first_page:].any()


def test_a_reserved_pool_costs_no_memory_until_written() -> None:
    before = rss_bytes_now()
    pools = ReservedPools(4, 1 << 16, (2, 8, 128), torch.float16)  # 4 x 256 MiB reserved
    assert rss_bytes_now() - before < 16 << 20
    pools.pools[0][:1024].fill_(1.0)  # 4 MiB written
    assert rss_bytes_now() - before >= 4 << 20
    pools.release_from(0)
    assert rss_bytes_now() - before < 16 << 20


async def test_an_idle_engine_gives_its_pool_back_beyond_what_it_keeps(smollm2) -> None:
    token_bytes = smollm2.config.kv_bytes_per_token(smollm2.cache_dtype.itemsize)
    keep = 16 * 8 * token_bytes  # sixteen blocks of eight tokens
    engine = Engine(smollm2, EngineConfig(batch=2, idle_kv_bytes=keep))
    try:
        assert engine.stats().kv_committed_bytes == 0
        prompt = smollm2.tokenizer.encode("The history of the Roman Empire begins " * 30)
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        held_while_running = 0
        async for _ in engine.submit(prompt, params):
            held_while_running = max(held_while_running, engine.stats().kv_committed_bytes)
        assert held_while_running >= len(prompt) * token_bytes
        for _ in range(500):  # the engine gives back once its loop sees it is idle
            if engine.stats().kv_committed_bytes <= keep:
                break
            await asyncio.sleep(0.01)
        assert engine.stats().kv_committed_bytes <= keep
        again = [e async for e in engine.submit(prompt, params)]
        assert again[-1].usage.cached_tokens == 16 * 8  # the kept blocks serve the prefix
    finally:
        engine.close()


GREEDY_FOUR = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


async def served_once(model, hold_s: float) -> tuple[Engine, list[int], int]:
    """An engine that keeps four blocks once idle, after `hold_s` of holding its whole pool,
    having served one prompt of ~300 tokens: the engine, the prompt and the bytes it keeps."""
    keep = 4 * 8 * model.config.kv_bytes_per_token(model.cache_dtype.itemsize)
    engine = Engine(model, EngineConfig(batch=2, idle_kv_bytes=keep, idle_hold_s=hold_s))
    prompt = model.tokenizer.encode("The history of the Roman Empire begins " * 30)
    [e async for e in engine.submit(prompt, GREEDY_FOUR)]
    return engine, prompt, keep


async def test_an_idle_engine_keeps_its_whole_pool_through_its_hold(smollm2) -> None:
    engine, prompt, _ = await served_once(smollm2, 60.0)
    try:
        await asyncio.sleep(0.3)  # long past an engine without a hold giving back
        token_bytes = smollm2.config.kv_bytes_per_token(smollm2.cache_dtype.itemsize)
        assert engine.stats().kv_committed_bytes >= len(prompt) * token_bytes
        again = [e async for e in engine.submit(prompt, GREEDY_FOUR)]
        full_blocks = (len(prompt) - 1) // 8 * 8
        assert again[-1].usage.cached_tokens == full_blocks  # not just the kept blocks
    finally:
        engine.close()


async def test_an_idle_engine_gives_its_pool_back_once_its_hold_has_passed(smollm2) -> None:
    engine, _, keep = await served_once(smollm2, 0.2)
    try:
        for _ in range(1000):  # no request wakes the engine: the hold's end alone does
            if engine.stats().kv_committed_bytes <= keep:
                break
            await asyncio.sleep(0.01)
        assert engine.stats().kv_committed_bytes <= keep
    finally:
        engine.close()


async def test_an_idle_engine_gives_its_pool_back_within_its_hold_when_asked(smollm2) -> None:
    engine, prompt, keep = await served_once(smollm2, 60.0)
    try:
        assert engine.stats().kv_committed_bytes > keep
        assert await asyncio.to_thread(engine.give_back_idle_memory) is True
        assert engine.stats().kv_committed_bytes <= keep
        again = [e async for e in engine.submit(prompt, GREEDY_FOUR)]
        assert again[-1].usage.cached_tokens == 4 * 8  # the blocks it keeps idle still serve
    finally:
        engine.close()


def rss_bytes_now() -> int:
    import os

    value = rss_bytes(os.getpid())
    assert value is not None
    return value


async def test_a_burst_of_long_rows_queues_within_the_pools_ceiling_and_every_row_finishes(smollm2):
    token_bytes = smollm2.config.kv_bytes_per_token(smollm2.cache_dtype.itemsize)
    ceiling = 40 * 8 * token_bytes  # forty blocks: room for two of these rows at a time
    engine = Engine(smollm2, EngineConfig(batch=4, kv_cache_bytes=ceiling))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        prompts = [
            smollm2.tokenizer.encode(f"Story {i}: " + "the rain fell on the hills. " * 14)
            for i in range(4)
        ]
        most = 0

        async def run(prompt: list[int]) -> str | None:
            nonlocal most
            last = None
            async for event in engine.submit(prompt, params):
                most = max(most, engine.stats().kv_committed_bytes)
                last = event
            assert last is not None
            return last.finish_reason

        reasons = await asyncio.gather(*(run(p) for p in prompts))
        assert reasons == ["length"] * 4  # every row got all its tokens
        assert 0 < most <= ceiling
    finally:
        engine.close()


def test_a_growing_pool_costs_memory_for_the_blocks_it_commits_not_for_its_ceiling():
    # A ceiling of hundreds of thousands of blocks used to cost every new engine (a switch)
    # ~0.15 s and ~60 MB making a record for each, whatever its rows would ever use.
    tracemalloc.start()
    try:
        manager = BlockManager(num_blocks=500_000, block_size=8, grows=True)
        compute_all(manager, make_seq(0, 20))
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert manager.num_committed == 3
    assert held < 1_000_000
