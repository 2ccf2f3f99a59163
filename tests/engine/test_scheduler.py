"""Scheduler: FIFO admission, chunked prefill, preemption, aborts and finishing."""

from __future__ import annotations

import random

import pytest

from modelhost.engine.kv.block_manager import BlockManager
from modelhost.engine.sampling.sampling_params import SamplingParams
from modelhost.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from modelhost.engine.sequence import ImageSpan, Sequence, SequenceStatus
from modelhost.models.vision.tower import ImagePlan

BS = 4
EOS = 2


def make_scheduler(
    num_blocks: int = 16,
    batch: int = 8,
    max_queue: int = 64,
    max_num_batched_tokens: int = 512,
) -> Scheduler:
    config = SchedulerConfig(batch, max_queue, max_num_batched_tokens)
    return Scheduler(config, BlockManager(num_blocks, BS))


def make_seq(
    seq_id: int,
    num_prompt_tokens: int,
    max_tokens: int = 16,
    ignore_eos: bool = False,
    stop_token_ids: tuple[int, ...] = (),
) -> Sequence:
    prompt = [1000 * seq_id + i for i in range(num_prompt_tokens)]  # no accidental sharing
    params = SamplingParams(
        max_tokens=max_tokens, ignore_eos=ignore_eos, stop_token_ids=stop_token_ids
    )
    return Sequence.from_prompt(seq_id, prompt, params, eos_token_ids=[EOS])


def step(sched: Scheduler, token_id: int = 7) -> tuple[SchedulerOutput, list[Sequence]]:
    """One engine step with a fake model that samples `token_id` for every sampling row."""
    out = sched.schedule()
    sched.block_manager.check_invariants()
    assert all(row.num_tokens >= 1 for row in out.rows)
    sampled = {row.seq.seq_id: token_id for row in out.rows if row.samples}
    finished = sched.update(out, sampled)
    sched.block_manager.check_invariants()
    return out, finished


def row_tokens(out: SchedulerOutput) -> dict[int, int]:
    return {row.seq.seq_id: row.num_tokens for row in out.rows}


def test_scheduler_admits_rows_fifo_up_to_the_batch_when_more_are_waiting() -> None:
    sched = make_scheduler(batch=2)
    for seq_id in (1, 2, 3):
        sched.add(make_seq(seq_id, 3))

    out, _ = step(sched)

    assert [row.seq.seq_id for row in out.rows] == [1, 2]
    assert [seq.seq_id for seq in sched.waiting] == [3]
    assert sched.num_running == 2


def test_scheduler_refuses_a_third_request_when_batch_and_queue_are_one() -> None:
    sched = make_scheduler(batch=1, max_queue=1, max_num_batched_tokens=8)
    assert sched.has_room()
    sched.add(make_seq(1, 3))
    assert sched.has_room()
    step(sched)  # row 1 runs
    assert sched.has_room()
    sched.add(make_seq(2, 3))

    assert (sched.num_running, sched.num_waiting) == (1, 1)
    assert not sched.has_room()


def test_scheduler_counts_pending_requests_when_checking_room() -> None:
    sched = make_scheduler(batch=1, max_queue=1)

    assert sched.has_room(num_pending_outside=1)
    assert not sched.has_room(num_pending_outside=2)


def test_scheduler_chunks_a_long_prompt_while_a_decoding_row_keeps_its_token_each_step() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    sched.add(make_seq(1, 3, max_tokens=100))
    step(sched)
    long = make_seq(2, 20, max_tokens=100)
    sched.add(long)

    chunks = []
    for _ in range(3):
        out, _ = step(sched)
        assert row_tokens(out)[1] == 1
        chunks.append((out.rows[1].num_tokens, out.rows[1].samples))

    assert chunks == [(7, False), (7, False), (6, True)]
    assert long.num_generated_tokens == 1


def test_scheduler_preempts_the_newest_row_when_blocks_run_out() -> None:
    sched = make_scheduler(num_blocks=4)
    older, newer = make_seq(1, 6, max_tokens=4), make_seq(2, 6, max_tokens=4)
    sched.add(older)
    sched.add(newer)
    for _ in range(3):  # prefill, then decode positions 6 and 7: both rows fill 2 blocks
        out, _ = step(sched)
        assert not out.preempted

    out, _ = step(sched)  # older needs a third block for position 8

    assert out.preempted == [newer]
    assert [row.seq for row in out.rows] == [older]
    assert newer.status is SequenceStatus.WAITING
    assert newer.block_table == [] and newer.num_computed_tokens == 0
    assert list(sched.waiting) == [newer]


def test_scheduler_resumes_a_preempted_row_with_its_generated_tokens_when_blocks_free_up() -> None:
    sched = make_scheduler(num_blocks=4)
    older, newer = make_seq(1, 6, max_tokens=4), make_seq(2, 6, max_tokens=4)
    sched.add(older)
    sched.add(newer)
    for token_id in (10, 11, 12):
        step(sched, token_id)
    _, finished = step(sched, 13)  # preempts newer; older reaches max_tokens
    assert finished == [older]
    assert newer.output_token_ids == [10, 11, 12]

    out, finished = step(sched, 14)

    (row,) = out.rows
    assert row.seq is newer and row.samples
    assert row.start == 4  # its head block came back from the prefix cache
    assert row.start + row.num_tokens == 9  # prompt plus generated tokens recomputed
    assert finished == [newer] and newer.finish_reason == "length"
    assert newer.output_token_ids == [10, 11, 12, 14]
    assert newer.num_prompt_tokens == 6
    assert newer.num_cached_tokens == 0  # the figure from its first scheduling


def test_scheduler_finishes_the_only_row_with_length_when_the_pool_cannot_hold_it() -> None:
    sched = make_scheduler(num_blocks=2)
    seq = make_seq(1, 5, max_tokens=100)
    assert sched.fits(5) and not sched.fits(8)
    sched.add(seq)
    for _ in range(4):  # positions 0..7 fill both blocks
        step(sched)

    out, _ = step(sched)

    assert out.finished == [seq] and out.rows == []
    assert seq.finish_reason == "length"
    assert seq.num_generated_tokens == 4
    assert sched.block_manager.num_used_blocks == 0


def test_scheduler_frees_a_waiting_row_at_the_next_schedule_when_it_is_aborted() -> None:
    sched = make_scheduler(batch=1)
    sched.add(make_seq(1, 3, max_tokens=100))
    waiting = make_seq(2, 3)
    sched.add(waiting)
    step(sched)

    sched.abort(2)
    assert waiting.aborted and sched.num_waiting == 1
    out, _ = step(sched)

    assert out.finished == [waiting]
    assert waiting.status is SequenceStatus.FINISHED and waiting.finish_reason == "abort"
    assert sched.num_waiting == 0


def test_scheduler_frees_a_running_rows_blocks_at_the_next_schedule_when_it_is_aborted() -> None:
    sched = make_scheduler()
    seq = make_seq(1, 9, max_tokens=100)
    sched.add(seq)
    step(sched)
    assert sched.block_manager.num_used_blocks == 3

    sched.abort(1)
    assert sched.block_manager.num_used_blocks == 3  # nothing happens until the next step
    out = sched.schedule()
    sched.block_manager.check_invariants()

    assert out.finished == [seq] and out.rows == []
    assert seq.finish_reason == "abort" and seq.block_table == []
    assert sched.block_manager.num_used_blocks == 0
    assert not sched.has_work


def test_scheduler_ignores_an_abort_when_the_id_is_unknown() -> None:
    sched = make_scheduler()
    sched.abort(99)

    out = sched.schedule()

    assert out.finished == [] and out.rows == []


def test_scheduler_finishes_with_length_when_max_tokens_is_reached() -> None:
    sched = make_scheduler()
    seq = make_seq(1, 3, max_tokens=3)
    sched.add(seq)

    finished = [step(sched)[1] for _ in range(3)]

    assert finished == [[], [], [seq]]
    assert seq.finish_reason == "length" and seq.num_generated_tokens == 3


def test_scheduler_finishes_with_stop_when_eos_is_sampled() -> None:
    sched = make_scheduler()
    seq = make_seq(1, 3, max_tokens=100)
    sched.add(seq)
    step(sched)

    _, finished = step(sched, EOS)

    assert finished == [seq]
    assert seq.finish_reason == "stop" and seq.output_token_ids == [7, EOS]


def test_scheduler_keeps_generating_past_eos_when_ignore_eos_is_set() -> None:
    sched = make_scheduler()
    seq = make_seq(1, 3, max_tokens=3, ignore_eos=True)
    sched.add(seq)

    finished = [step(sched, EOS)[1] for _ in range(3)]

    assert finished == [[], [], [seq]]
    assert seq.finish_reason == "length"


def test_scheduler_finishes_with_stop_when_a_stop_token_id_is_sampled() -> None:
    sched = make_scheduler()
    seq = make_seq(1, 3, max_tokens=100, ignore_eos=True, stop_token_ids=(9,))
    sched.add(seq)

    _, finished = step(sched, 9)

    assert finished == [seq] and seq.finish_reason == "stop"


def test_scheduler_frees_a_row_immediately_when_the_engine_finishes_it() -> None:
    sched = make_scheduler()
    seq = make_seq(1, 3, max_tokens=100)
    sched.add(seq)
    out = sched.schedule()

    sched.finish(seq, "stop")  # e.g. a stop string matched in the engine
    finished = sched.update(out, {1: 7})

    assert finished == [] and seq.finish_reason == "stop"
    assert sched.block_manager.num_used_blocks == 0 and not sched.has_work
    sched.block_manager.check_invariants()


def test_scheduler_reports_cached_tokens_when_a_second_turn_shares_the_prefix() -> None:
    sched = make_scheduler()
    first = make_seq(1, 10, max_tokens=2)
    sched.add(first)
    while sched.has_work:
        step(sched)
    second_prompt = first.token_ids + [5, 6, 7]
    second = Sequence.from_prompt(2, second_prompt, SamplingParams(max_tokens=1))
    sched.add(second)

    out, _ = step(sched)

    assert second.num_cached_tokens == 8
    assert out.rows[0].start == 8 and out.rows[0].num_tokens == 7


def test_scheduler_rejects_a_config_when_the_token_budget_is_below_the_batch() -> None:
    with pytest.raises(ValueError):
        SchedulerConfig(batch=8, max_num_batched_tokens=4)


def test_scheduler_returns_blocks_to_baseline_when_every_row_finishes() -> None:
    rng = random.Random(7)
    sched = make_scheduler(num_blocks=10, batch=4, max_num_batched_tokens=16)
    bm = sched.block_manager
    shared = [rng.randrange(100) for _ in range(9)]
    added: list[Sequence] = []
    num_preempted = 0
    for seq_id in range(40):
        if rng.random() < 0.5:
            prompt = shared[: rng.randrange(1, 10)] + [rng.randrange(100)]
        else:
            prompt = [rng.randrange(100) for _ in range(rng.randrange(1, 20))]
        seq = Sequence.from_prompt(
            seq_id, prompt, SamplingParams(max_tokens=rng.randrange(1, 12)), eos_token_ids=[EOS]
        )
        assert sched.fits(seq.num_tokens)
        sched.add(seq)
        added.append(seq)
        if rng.random() < 0.1:
            sched.abort(rng.choice(added).seq_id)
        out = sched.schedule()
        bm.check_invariants()
        num_preempted += len(out.preempted)
        sched.update(out, {row.seq.seq_id: rng.randrange(100) for row in out.rows if row.samples})
        bm.check_invariants()
    for _ in range(1000):
        if not sched.has_work:
            break
        out, _ = step(sched, rng.randrange(3, 100))
        num_preempted += len(out.preempted)

    assert num_preempted > 0  # the small pool did force preemptions
    assert not sched.has_work
    assert all(seq.is_finished for seq in added)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 10
    assert all(seq.finish_reason in ("stop", "length", "abort") for seq in added)


def test_prefill_chunks_of_a_bidirectional_model_end_before_an_image_or_at_its_end() -> None:
    """Gemma 3's image tokens attend both ways: a chunk never ends inside an image (it ends
    before it, or runs on to its end past the budget)."""
    config = SchedulerConfig(batch=2, max_num_batched_tokens=6, whole_images=True)
    sched = Scheduler(config, BlockManager(16, BS))
    span = ImageSpan(4, 8, b"image", ImagePlan("", 8, None), tuple(range(4, 12)))
    prompt = list(range(100, 116))
    seq = Sequence.from_prompt(1, prompt, SamplingParams(max_tokens=2), images=(span,))
    sched.add(seq)
    chunks = [step(sched)[0].rows[0].num_tokens for _ in range(3)]
    assert chunks == [4, 8, 4]
