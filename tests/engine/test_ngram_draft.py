"""Prompt-lookup drafts and each row's adaptive guessing state, without a model."""

from __future__ import annotations

from modelhost.engine.block_manager import BlockManager
from modelhost.engine.ngram_draft import NgramIndex
from modelhost.engine.sampling_params import SamplingParams
from modelhost.engine.sequence import Sequence
from modelhost.engine.speculation import (
    FIRST_PAUSE_STEPS,
    MAX_K,
    MISSES_BEFORE_PAUSE,
    RowSpeculation,
)


def test_a_draft_is_what_followed_the_latest_earlier_occurrence_of_the_last_tokens():
    tokens = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert NgramIndex().propose(tokens, 3) == [7, 8, 1]


def test_the_longest_matching_tail_wins_over_a_later_shorter_one():
    # [2, 3] last appeared before 9, but [1, 2, 3] only before 4.
    tokens = [1, 2, 3, 4, 5, 6, 2, 3, 9, 1, 2, 3]
    assert NgramIndex().propose(tokens, 2) == [4, 5]


def test_no_draft_when_the_tail_never_appeared_before():
    assert NgramIndex().propose([1, 2, 3, 4, 5, 6], 4) == []


def test_a_draft_stops_at_the_end_of_the_tokens_and_follows_them_as_they_grow():
    index = NgramIndex()
    tokens = [5, 6, 7, 5, 6]
    assert index.propose(tokens, 8) == [7, 5, 6]
    tokens += [8, 5, 6]
    assert index.propose(tokens, 2) == [8, 5]


def test_a_row_whose_guesses_all_land_guesses_more():
    state = RowSpeculation()
    before = state.k
    state.learn(before, before)
    assert state.k == min(MAX_K, before + 2)
    state.learn(state.k, 1)
    assert state.k == 2


def test_a_row_whose_guesses_keep_failing_pauses_then_tries_again():
    state = RowSpeculation()
    for _ in range(MISSES_BEFORE_PAUSE):
        assert state.wants_to_guess()
        state.learn(4, 0)
    paused = [state.wants_to_guess() for _ in range(FIRST_PAUSE_STEPS)]
    assert not any(paused)
    assert state.wants_to_guess()
    for _ in range(MISSES_BEFORE_PAUSE):  # failing again pauses twice as long
        state.learn(1, 0)
    assert state.pause == 2 * FIRST_PAUSE_STEPS


def test_trimming_gives_back_the_blocks_past_the_computed_tokens():
    manager = BlockManager(num_blocks=8, block_size=4)
    seq = Sequence.from_prompt(1, list(range(6)), SamplingParams())
    manager.allocate_prompt(seq)
    manager.append_slots(seq, 6 + 7)  # a prompt and a seven-token guess: four blocks
    assert len(seq.block_table) == 4
    seq.num_computed_tokens = 7
    manager.trim(seq)
    assert len(seq.block_table) == 2
    assert manager.num_free_blocks == 6
    manager.check_invariants()
