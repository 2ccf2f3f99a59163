"""Token-budget scheduling: which rows run this step, with how many tokens each.

One step's plan is a `SchedulerOutput`. Running rows go first, in FIFO order: a row still
prefilling gets a chunk of its remaining prompt, a decoding row gets one token, so a long prompt
never stalls the streams already running. Waiting rows are then admitted FIFO while there are
free row slots and tokens left in the budget. When the KV pool runs out, the newest running row
is preempted: its blocks are freed and it goes back to the front of the queue, to recompute its
prompt and generated tokens later (its full blocks usually come back from the prefix cache).

Called from the engine thread only; no locking. Pure Python: no torch, no asyncio.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from modelhost.engine.events import FinishReason
from modelhost.engine.kv.block_manager import BlockManager
from modelhost.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    batch: int = 8  # running rows
    max_queue: int = 64  # waiting rows beyond the free running slots
    max_num_batched_tokens: int = 512  # tokens per step, prefill chunks and decodes together
    # A prefill chunk never ends inside an image (Gemma 3: an image's tokens attend to each
    # other both ways, so one step must compute them all): it ends before the image, or runs
    # on to the image's end even past the step's budget.
    whole_images: bool = False

    def __post_init__(self) -> None:
        if self.batch < 1:
            raise ValueError("batch must be >= 1")
        if self.max_queue < 0:
            raise ValueError("max_queue must be >= 0")
        if self.max_num_batched_tokens < self.batch:
            raise ValueError("max_num_batched_tokens must be >= batch")


@dataclass(slots=True)
class ScheduledRow:
    seq: Sequence
    start: int  # seq.num_computed_tokens when scheduled: the first position computed this step
    num_tokens: int  # >= 1
    samples: bool  # the chunk reaches the last token, so this row yields a next token
    # Guessed tokens computed after the row's last one (engine/speculation.py): num_tokens is
    # 1 + len(draft), and `settle_verified` records the step instead of `update`.
    draft: list[int] = field(default_factory=list)
    # With a draft model's drawn guesses: the distribution each was drawn from (a torch tensor,
    # [len(draft), vocab]), for speculative sampling; None for guesses kept only where the
    # sampled token is the guess.
    draft_probs: object = None


@dataclass(slots=True)
class SchedulerOutput:
    rows: list[ScheduledRow] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)  # aborted or impossible this step
    preempted: list[Sequence] = field(default_factory=list)  # sent back to the queue this step

    @property
    def num_batched_tokens(self) -> int:
        return sum(row.num_tokens for row in self.rows)

    @property
    def is_empty(self) -> bool:
        return not self.rows


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._aborting: set[int] = set()
        self._seqs: dict[int, Sequence] = {}  # every sequence not yet finished, by id

    # ---- queue ----------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def has_room(self, num_pending_outside: int = 0) -> bool:
        """Whether one more request may queue; free running slots count as capacity."""
        free_slots = max(0, self.config.batch - len(self.running))
        return len(self.waiting) + num_pending_outside < self.config.max_queue + free_slots

    def fits(self, num_tokens: int) -> bool:
        """Whether a prompt of `num_tokens` plus one generated token can ever fit the KV pool."""
        return self.block_manager.fits(num_tokens)

    def add(self, seq: Sequence) -> None:
        assert seq.status is SequenceStatus.WAITING and not seq.block_table
        assert seq.seq_id not in self._seqs, f"sequence {seq.seq_id} added twice"
        self._seqs[seq.seq_id] = seq
        self.waiting.append(seq)

    def abort(self, seq_id: int) -> None:
        """Mark a row for removal at the next `schedule()`; unknown or finished ids are ignored."""
        seq = self._seqs.get(seq_id)
        if seq is not None:
            seq.aborted = True
            self._aborting.add(seq_id)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Finish a row now (the engine matched a stop string, say); idempotent."""
        if not seq.is_finished:
            self._finish(seq, reason)

    # ---- one step -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._sweep_aborted(out)
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:  # a step that had to preempt admits nobody, or it would thrash
            self._admit_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        bm = self.block_manager
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            start = seq.num_computed_tokens
            want = self._whole_images(seq, start, min(seq.num_tokens - start, budget), True)
            assert want >= 1
            num_tokens = self._appendable(seq, want)
            while num_tokens == 0:
                if not bm.fits(start):  # the pool can never hold the next position
                    self._finish(seq, "length")
                    out.finished.append(seq)
                    break
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
                num_tokens = self._appendable(seq, want)
            if num_tokens == 0:
                continue  # seq left `running`; index i now holds the next row
            bm.append_slots(seq, num_tokens)
            out.rows.append(_row(seq, num_tokens))
            budget -= num_tokens
            i += 1
        return budget

    def _appendable(self, seq: Sequence, want: int) -> int:
        """As many of `want` tokens as the KV pool takes, cut before an image they would end
        inside (maybe 0)."""
        num_tokens = self.block_manager.max_appendable(seq, want)
        if num_tokens < want:
            num_tokens = self._whole_images(seq, seq.num_computed_tokens, num_tokens, False)
        return num_tokens

    def _whole_images(self, seq: Sequence, start: int, num_tokens: int, extend: bool) -> int:
        """`num_tokens` from `start`, moved so the chunk does not end inside an image: back to
        the image's first token, or (`extend`, when that leaves nothing) on to its end."""
        if not self.config.whole_images or num_tokens == 0:
            return num_tokens
        end = start + num_tokens
        for span in seq.images:
            span_end = span.start + span.length
            if span.start < end < span_end:
                if span.start > start:
                    return span.start - start
                return span_end - start if extend else 0
        return num_tokens

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        bm = self.block_manager
        while self.waiting and len(self.running) < self.config.batch and budget > 0:
            seq = self.waiting[0]
            if not bm.fits(seq.num_tokens - 1):  # grown past the pool while preempted
                self._finish(seq, "length")
                out.finished.append(seq)
                continue
            if not bm.can_allocate_prompt(seq):
                break
            self.waiting.popleft()
            num_cached = bm.allocate_prompt(seq)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_cached
            start = seq.num_computed_tokens
            want = self._whole_images(seq, start, min(seq.num_tokens - start, budget), True)
            num_tokens = self._appendable(seq, want)
            if num_tokens == 0:  # an image's tokens do not fit in one step yet: wait
                bm.free(seq)
                seq.num_computed_tokens = 0
                self.waiting.appendleft(seq)
                break
            bm.append_slots(seq, num_tokens)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.rows.append(_row(seq, num_tokens))
            budget -= num_tokens

    def update(self, out: SchedulerOutput, sampled: dict[int, int]) -> list[Sequence]:
        """Record a finished forward pass; `sampled` maps seq_id to the token sampled for it.

        Returns the rows that finished (stop token or max_tokens) in this update.
        """
        finished: list[Sequence] = []
        for row in out.rows:
            seq = row.seq
            if seq.is_finished:  # the engine finished it between schedule and update
                continue
            assert seq.num_computed_tokens == row.start, "row updated twice"
            seq.num_computed_tokens += row.num_tokens
            self.block_manager.commit_full_blocks(seq)
            if not row.samples:
                continue
            token_id = sampled[seq.seq_id]
            seq.append_token(token_id)
            reason = _stop_reason(seq, token_id)
            if reason is not None:
                self._finish(seq, reason)
                finished.append(seq)
        return finished

    def accept_token(self, seq: Sequence, token_id: int) -> FinishReason | None:
        """Append one token of a verified row (see `settle_verified`), finishing the row when
        it ends it, as `update` does for a decode row's one token."""
        seq.append_token(token_id)
        reason = _stop_reason(seq, token_id)
        if reason is not None:
            self._finish(seq, reason)
        return reason

    def settle_verified(self, row: ScheduledRow, num_appended: int) -> None:
        """Record a verified row's step once `accept_token` appended `num_appended` tokens:
        the KV of its last token and of the guesses that were kept is computed, the blocks
        grown for guesses that were not go back to the pool (their slots were never committed)."""
        seq = row.seq
        if seq.is_finished:
            return
        assert seq.num_computed_tokens == row.start, "row updated twice"
        seq.num_computed_tokens = row.start + num_appended
        self.block_manager.commit_full_blocks(seq)
        self.block_manager.trim(seq)

    # ---- transitions ----------------------------------------------------------------------

    def _sweep_aborted(self, out: SchedulerOutput) -> None:
        for seq_id in sorted(self._aborting):
            seq = self._seqs.get(seq_id)
            if seq is not None and not seq.is_finished:
                self._finish(seq, "abort")
                out.finished.append(seq)
        self._aborting.clear()

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self._seqs.pop(seq.seq_id, None)


def _row(seq: Sequence, num_tokens: int) -> ScheduledRow:
    start = seq.num_computed_tokens
    return ScheduledRow(seq, start, num_tokens, samples=start + num_tokens == seq.num_tokens)


def _stop_reason(seq: Sequence, token_id: int) -> FinishReason | None:
    params = seq.params
    if token_id in params.stop_token_ids:
        return "stop"
    if not params.ignore_eos and token_id in seq.eos_token_ids:
        return "stop"
    if seq.num_generated_tokens >= params.max_tokens:
        return "length"
    return None
