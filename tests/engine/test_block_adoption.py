"""Blocks computed elsewhere (read back from a disk store) join the prefix cache: the next
prompt's match finds them, and they are the last free blocks handed out."""

from __future__ import annotations

from modelhost.engine.kv.block_manager import BlockManager
from modelhost.engine.kv.prefix_store import chain_key
from modelhost.engine.sampling.sampling_params import SamplingParams
from modelhost.engine.sequence import Sequence

BS = 4


def seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence.from_prompt(seq_id, tokens, SamplingParams(max_tokens=4))


def test_an_adopted_chain_is_matched_by_a_prompt_that_starts_with_it() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    first, second = (1, 2, 3, 4), (5, 6, 7, 8)
    k1 = chain_key(None, first)
    k2 = chain_key(k1, second)
    bm.adopt(k1, None, first)
    bm.adopt(k2, k1, second)
    assert bm.touch(k2, k1, second) is True
    row = seq(1, [*first, *second, 9])
    assert bm.allocate_prompt(row) == 8
    bm.check_invariants()


def test_a_block_is_not_found_under_its_key_with_other_tokens() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    key = chain_key(None, (1, 2, 3, 4))
    bm.adopt(key, None, (1, 2, 3, 4))
    assert bm.touch(key, None, (9, 9, 9, 9)) is None


def test_adopted_blocks_are_handed_out_after_every_other_free_block() -> None:
    bm = BlockManager(num_blocks=3, block_size=BS)
    key = chain_key(None, (1, 2, 3, 4))
    adopted = bm.adopt(key, None, (1, 2, 3, 4))
    row = seq(1, list(range(100, 108)))
    bm.allocate_prompt(row)
    bm.append_slots(row, 8)  # two blocks: the two that were never cached
    assert adopted not in row.block_table
    assert bm.block_key(adopted) == key


def test_committed_blocks_are_told_to_the_commit_hook_once_with_their_chain() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    told: list[tuple[bytes, bytes | None, tuple[int, ...]]] = []
    bm.on_commit = lambda block_id, key, parent, tokens: told.append((key, parent, tokens))
    row = seq(1, list(range(9)))
    bm.allocate_prompt(row)
    bm.append_slots(row, 9)
    row.num_computed_tokens = 9
    bm.commit_full_blocks(row)
    bm.commit_full_blocks(row)
    k1 = chain_key(None, (0, 1, 2, 3))
    assert told == [(k1, None, (0, 1, 2, 3)), (chain_key(k1, (4, 5, 6, 7)), k1, (4, 5, 6, 7))]
