"""BlockManager: reference counts, the LRU free list and chained-hash prefix reuse."""

from __future__ import annotations

import random

import pytest

from modelhost.engine.kv import block_manager as block_manager_module
from modelhost.engine.kv.block_manager import BlockManager, OutOfBlocks
from modelhost.engine.sampling.sampling_params import SamplingParams
from modelhost.engine.sequence import Sequence

BS = 4


def make_seq(seq_id: int, token_ids: list[int]) -> Sequence:
    return Sequence.from_prompt(seq_id, token_ids, SamplingParams())


def compute_all(bm: BlockManager, seq: Sequence) -> None:
    """Allocate what the prompt needs and pretend the runner computed every token's KV."""
    bm.allocate_prompt(seq)
    bm.append_slots(seq, seq.num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.commit_full_blocks(seq)
    bm.check_invariants()


def test_block_manager_returns_cached_tokens_when_prompt_shares_full_blocks() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    first = make_seq(1, list(range(10)))
    compute_all(bm, first)
    second = make_seq(2, list(range(8)) + [50, 51, 52])

    num_cached = bm.allocate_prompt(second)

    assert num_cached == 8
    assert second.num_computed_tokens == 8
    assert second.block_table == first.block_table[:2]
    bm.check_invariants()


def test_block_manager_never_reuses_the_last_token_when_prompt_is_fully_cached() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    compute_all(bm, make_seq(1, list(range(8))))
    same = make_seq(2, list(range(8)))

    num_cached = bm.allocate_prompt(same)

    assert num_cached == 4  # the second block holds the last token, which must be recomputed
    assert same.num_computed_tokens < same.num_tokens
    bm.check_invariants()


def test_block_manager_reuses_freed_hashed_block_when_identical_prompt_returns() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    first = make_seq(1, list(range(9)))
    compute_all(bm, first)
    head_blocks = first.block_table[:2]
    bm.free(first)
    assert bm.num_used_blocks == 0
    assert bm.num_cached_free_blocks == 2

    again = make_seq(2, list(range(9)))
    num_cached = bm.allocate_prompt(again)

    assert num_cached == 8
    assert again.block_table == head_blocks
    assert bm.num_cached_free_blocks == 0
    bm.check_invariants()


def test_block_manager_misses_when_the_prefix_differs_in_an_earlier_block() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    compute_all(bm, make_seq(1, [0, 1, 2, 3, 4, 5, 6, 7, 8]))
    other = make_seq(2, [9, 1, 2, 3, 4, 5, 6, 7, 8])  # same second block, different chain

    assert bm.allocate_prompt(other) == 0
    bm.check_invariants()


def test_block_manager_hands_out_unhashed_blocks_first_when_allocating() -> None:
    bm = BlockManager(num_blocks=3, block_size=BS)
    seq = make_seq(1, list(range(9)))  # blocks: full, full, partial (unhashed)
    compute_all(bm, seq)
    partial_block = seq.block_table[2]
    bm.free(seq)

    fresh = make_seq(2, [70])
    bm.allocate_prompt(fresh)
    bm.append_slots(fresh, 1)

    assert fresh.block_table == [partial_block]
    assert bm.num_cached_free_blocks == 2
    bm.check_invariants()


def test_block_manager_evicts_least_recently_freed_hashed_block_first_when_pool_is_full() -> None:
    bm = BlockManager(num_blocks=2, block_size=BS)
    older = make_seq(1, [1, 1, 1, 1])
    compute_all(bm, older)
    older_block = older.block_table[0]
    newer = make_seq(2, [2, 2, 2, 2])
    compute_all(bm, newer)
    bm.free(older)
    bm.free(newer)
    assert bm.num_cached_free_blocks == 2

    taker = make_seq(3, [3])
    bm.allocate_prompt(taker)
    bm.append_slots(taker, 1)

    assert taker.block_table == [older_block]
    assert bm.allocate_prompt(make_seq(4, [2, 2, 2, 2, 9])) == 4  # the newer one survived
    bm.check_invariants()


def test_block_manager_evicts_tail_before_head_when_one_sequence_is_freed() -> None:
    bm = BlockManager(num_blocks=2, block_size=BS)
    seq = make_seq(1, list(range(8)))
    compute_all(bm, seq)
    head, tail = seq.block_table
    bm.free(seq)

    taker = make_seq(2, [99])
    bm.allocate_prompt(taker)
    bm.append_slots(taker, 1)

    assert taker.block_table == [tail]
    assert bm.allocate_prompt(make_seq(3, list(range(8)))) == 4
    assert bm.ref_count(head) == 1
    bm.check_invariants()


def test_block_manager_shares_ref_counts_when_two_live_sequences_share_a_prefix() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    first = make_seq(1, list(range(6)))
    compute_all(bm, first)
    second = make_seq(2, list(range(4)) + [40, 41])
    bm.allocate_prompt(second)
    bm.append_slots(second, 2)
    shared = first.block_table[0]

    assert second.block_table[0] == shared
    assert bm.ref_count(shared) == 2
    assert bm.num_used_blocks == 3
    bm.check_invariants()

    bm.free(first)
    assert bm.ref_count(shared) == 1
    assert bm.num_used_blocks == 2
    bm.check_invariants()


def test_block_manager_keeps_the_existing_mapping_when_a_duplicate_block_is_committed() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    first = make_seq(1, list(range(5)))
    second = make_seq(2, list(range(5)))
    bm.allocate_prompt(first)
    bm.allocate_prompt(second)  # nothing cached yet: both compute the same block
    for seq in (first, second):
        bm.append_slots(seq, 5)
        seq.num_computed_tokens = 5
    bm.commit_full_blocks(first)
    bm.commit_full_blocks(second)

    assert bm.block_key(first.block_table[0]) is not None
    assert bm.block_key(second.block_table[0]) is None
    bm.check_invariants()


def test_block_manager_refuses_a_cached_block_when_its_hash_collides(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(block_manager_module, "hash", lambda _: 42, raising=False)
    bm = BlockManager(num_blocks=8, block_size=BS)
    compute_all(bm, make_seq(1, [1, 2, 3, 4, 5]))

    assert bm.allocate_prompt(make_seq(2, [5, 6, 7, 8, 9])) == 0
    bm.check_invariants()


def test_block_manager_counts_free_prefix_hits_when_checking_prompt_allocation() -> None:
    bm = BlockManager(num_blocks=2, block_size=BS)
    cached = make_seq(1, [1, 2, 3, 4, 5])
    compute_all(bm, cached)
    bm.free(cached)
    holder = make_seq(2, [9])
    bm.allocate_prompt(holder)
    bm.append_slots(holder, 1)  # takes the unhashed block; only the cached one is free

    assert not bm.can_allocate_prompt(make_seq(3, [1, 2, 3, 4, 6]))
    bm.free(holder)
    assert bm.can_allocate_prompt(make_seq(3, [1, 2, 3, 4, 6]))
    bm.check_invariants()


def test_block_manager_raises_when_appending_beyond_the_free_blocks() -> None:
    bm = BlockManager(num_blocks=2, block_size=BS)
    seq = make_seq(1, list(range(12)))
    bm.allocate_prompt(seq)

    assert not bm.can_append(seq, 9)
    assert bm.max_appendable(seq, 12) == 8
    with pytest.raises(OutOfBlocks):
        bm.append_slots(seq, 9)
    bm.check_invariants()


def test_block_manager_maps_positions_to_slots_through_the_block_table() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    seq = make_seq(1, list(range(6)))
    seq.block_table.extend([3, 1])

    assert [bm.slot(seq, p) for p in range(6)] == [12, 13, 14, 15, 4, 5]


def test_block_manager_reports_the_hit_ratio_when_prompts_are_queried() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    compute_all(bm, make_seq(1, list(range(8))))
    bm.allocate_prompt(make_seq(2, list(range(8))))

    assert bm.num_prefix_queries_tokens == 16
    assert bm.num_prefix_hit_tokens == 4
    assert bm.prefix_hit_ratio == pytest.approx(0.25)


def test_block_manager_keeps_invariants_when_random_sequences_allocate_grow_and_free() -> None:
    rng = random.Random(1234)
    bm = BlockManager(num_blocks=12, block_size=BS)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 14))] for _ in range(4)]
    live: list[Sequence] = []
    next_id = 0
    for _ in range(400):
        op = rng.random()
        if op < 0.4:
            prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(3))]
            seq = make_seq(next_id, prompt)
            next_id += 1
            if bm.can_allocate_prompt(seq):
                bm.allocate_prompt(seq)
                num_new = bm.max_appendable(seq, seq.num_tokens - seq.num_computed_tokens)
                assert num_new >= 1
                bm.append_slots(seq, num_new)
                seq.num_computed_tokens += num_new
                bm.commit_full_blocks(seq)
                live.append(seq)
        elif op < 0.75 and live:
            seq = rng.choice(live)
            if seq.num_computed_tokens == seq.num_tokens:
                seq.append_token(rng.randrange(50))
            if bm.can_append(seq, 1):
                bm.append_slots(seq, 1)
                seq.num_computed_tokens += 1
                bm.commit_full_blocks(seq)
        elif live:
            bm.free(live.pop(rng.randrange(len(live))))
        bm.check_invariants()
    for seq in live:
        bm.free(seq)
    bm.check_invariants()
    assert bm.num_used_blocks == 0
    assert bm.num_free_blocks == 12
    assert bm.num_prefix_hit_tokens > 0  # the loop did exercise the prefix cache
