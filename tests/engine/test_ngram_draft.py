"""Prompt-lookup drafts and each row's adaptive guessing state, without a model."""

from __future__ import annotations

from modelhost.engine.kv.block_manager import BlockManager
from modelhost.engine.ngram_draft import NgramIndex
from modelhost.engine.sampling.sampling_params import SamplingParams
from modelhost.engine.scheduler import ScheduledRow, SchedulerOutput
from modelhost.engine.sequence import Sequence
from modelhost.engine.speculation import (
    FIRST_PAUSE_STEPS,
    MAX_K,
    MISSES_BEFORE_PAUSE,
    RowSpeculation,
    Speculator,
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
    state = RowSpeculation().ngram
    before = state.k
    state.learn(before, before)
    assert state.k == min(MAX_K, before + 2)
    state.learn(state.k, 1)
    assert state.k == 2


def test_a_row_whose_guesses_keep_failing_pauses_then_tries_again():
    state = RowSpeculation().ngram
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


def decoding_step(prompt: list[int], token: int) -> tuple[SchedulerOutput, BlockManager]:
    """A step where one row decodes its first generated token after `prompt`."""
    manager = BlockManager(num_blocks=64, block_size=4)
    seq = Sequence.from_prompt(1, prompt, SamplingParams(temperature=0, max_tokens=50))
    manager.allocate_prompt(seq)
    manager.append_slots(seq, len(prompt))
    seq.num_computed_tokens = len(prompt)
    seq.append_token(token)
    manager.append_slots(seq, 1)
    return SchedulerOutput(rows=[ScheduledRow(seq, len(prompt), 1, True)]), manager


REPEATING = [1, 2, 3, 4, 5, 6, 7, 8, 9] * 3


def test_auto_guesses_everything_while_wider_steps_cost_no_more():
    speculator = Speculator("auto", exact=True)
    for size in range(1, 10):
        speculator.record_step(size, 0.01)
    out, manager = decoding_step(REPEATING, 1)
    assert speculator.plan(out, manager, budget=512)
    assert out.rows[0].draft == [2, 3, 4, 5]  # the row's whole first guess
    assert out.rows[0].num_tokens == 5


def test_auto_does_not_guess_where_wider_steps_cost_more_than_the_guesses_yield():
    speculator = Speculator("auto", exact=True)
    speculator.record_step(1, 0.01)
    for size in range(2, 10):
        speculator.record_step(size, 0.03)  # arithmetic-bound: three times one row's step
    out, manager = decoding_step(REPEATING, 1)
    assert not speculator.plan(out, manager, budget=512)
    assert out.rows[0].num_tokens == 1 and out.rows[0].draft == []
    ngram = Speculator("ngram", exact=True)  # ngram guesses whatever it costs
    out, manager = decoding_step(REPEATING, 1)
    assert ngram.plan(out, manager, budget=512)


def test_a_model_where_guessing_is_not_exact_never_guesses():
    speculator = Speculator("ngram", exact=False)
    out, manager = decoding_step(REPEATING, 1)
    assert speculator.mode == "none"
    assert not speculator.plan(out, manager, budget=512)
