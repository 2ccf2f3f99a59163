"""Speculation: which rows guess this step, how many tokens, from where, and what they learned.

A decoding row may carry a draft of k guessed tokens into a step, taken from its own context
(n-gram lookup, engine/ngram_draft.py) or from a small draft model with the same tokenizer run
k steps ahead (engine/draft_model.py). Its
last token and the k guesses are k + 1 generated-token positions, computed in the same forward
as the other rows. The engine then samples those positions one after the other, exactly as k + 1
decode steps would (the same sampler, the same row state, one uniform drawn per emitted token),
and stops at the first sampled token that is not the next guess: that token is the bonus, the
guesses before it are accepted, the rest are dropped and their KV slots are reused later.

Why this is exact: a verification step is built as a decode step whose "rows" are the row's
positions (runner.py): every position runs through the same per-token kernels (packed weights,
paged attention over its own row's keys up to its position, the fused decode path) as a
one-token decode step, and on the native kernels no token's result depends on the tokens beside
it. So at temperature 0 the tokens are the ones plain decoding gives, and with a seed the draws
are too (a rejected guess is no different from sampling p with that token ruled out, renormalised:
speculative sampling with a point-mass draft). `exact_for` refuses models where that argument
does not hold (PyTorch's own matmuls, longrope's per-step table switch): they never speculate.

With a draft model, a row that samples without a seed gets guesses drawn from the draft's
distribution q instead, and each is kept with probability min(1, p/q) or replaced by a draw
from the residual (speculative sampling, sampling/speculative_sampling.py): the tokens are
distributed as the model's own, and more of them are kept than best-token guesses would be.

Adaptive, per row and per source of guesses: a row's draft length grows while all its guesses
land and shrinks to what landed otherwise; after MISSES_BEFORE_PAUSE drafts in a row with
nothing accepted it stops guessing for a pause that doubles each time (up to MAX_PAUSE_STEPS)
and then tries again.

Per step (`auto`): a cost model decides how many guesses are worth verifying. The engine reports
each decode step's time (forward, sampling, emitting) by its number of token rows (`observe`),
and a step size costs the least of its recent times (engine/step_costs.py); a guess at depth i
of a row whose guesses land at rate p yields p ** i tokens on average; the step verifies the
guesses that maximise the expected tokens a second. Where extra rows are nearly free (on the
native kernels each weight is read once for up to 8 token rows, and a step of a big model is
bound by that read) most guesses are worth it; where they are not (a tiny model on few cores is
bound by arithmetic, and a full batch already fills the rows), few or none are. A draft model's
guesses also cost its forwards (one per depth, measured): `auto` counts them. In `auto` a row
guesses from its context where that finds a match (free), else from the draft model where one is
configured. `ngram` verifies every row's context guesses whatever they cost, `draft` every row's
draft-model guesses. Steps that prefill a prompt, or preempted a row, never guess:
they are not decode steps. Rows with a readout never guess (their answers are one token).
Rows with a grammar do (a schema's keys and a quoted value copy well): their positions are
sampled one after the other under the grammar's mask, the state advanced by each kept token, so
a guess the grammar forbids is never the sampled token and is rejected there; their draft-model
guesses are the draft's best tokens (the draft knows no grammar).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from modelhost.engine.kv.block_manager import BlockManager
from modelhost.engine.ngram_draft import NgramIndex
from modelhost.engine.scheduler import ScheduledRow, SchedulerOutput
from modelhost.engine.sequence import Sequence
from modelhost.engine.step_costs import StepCosts

if TYPE_CHECKING:
    from modelhost.engine.draft_model import DraftModel
    from modelhost.engine.sampling.sampler import RowSamplingState
    from modelhost.models.loaded import LoadedModel

SpeculateMode = Literal["auto", "ngram", "draft", "none"]
SPECULATE_MODES: tuple[SpeculateMode, ...] = ("auto", "ngram", "draft", "none")
GuessSource = Literal["ngram", "draft"]


def speculate_mode(name: str) -> SpeculateMode:
    """`name` as a mode (`--speculate`), or ValueError."""
    for mode in SPECULATE_MODES:
        if mode == name:
            return mode
    raise ValueError(f"speculate must be one of {', '.join(SPECULATE_MODES)}, not {name!r}")


FIRST_RATE = 0.5  # a new row's guesses are assumed to land this often
RATE_WEIGHT = 0.3  # of a verification's acceptance in the row's running rate
RATE_RECOVERY = 0.05  # a step without guessing moves a row's rate this far back to FIRST_RATE
START_K = 4
MAX_K = 8
MISSES_BEFORE_PAUSE = 3
FIRST_PAUSE_STEPS = 8
MAX_PAUSE_STEPS = 256


@dataclass(slots=True)
class GuessState:
    """How one source of guesses has fared for one row: its draft length, rate and pause."""

    k: int = START_K
    misses: int = 0  # drafts in a row with nothing accepted
    pause: int = 0  # steps left without guessing
    next_pause: int = FIRST_PAUSE_STEPS
    rate: float = FIRST_RATE  # running share of guesses accepted

    def wants_to_guess(self) -> bool:
        if self.pause > 0:
            self.pause -= 1
            return False
        return True

    def learn(self, num_drafted: int, num_accepted: int) -> None:
        self.rate += RATE_WEIGHT * (num_accepted / num_drafted - self.rate)
        if num_accepted == num_drafted:
            self.k = min(MAX_K, self.k + 2)
        else:
            self.k = max(1, num_accepted + 1)
        if num_accepted:
            self.misses = 0
            self.next_pause = FIRST_PAUSE_STEPS
            return
        self.misses += 1
        if self.misses >= MISSES_BEFORE_PAUSE:
            self.misses = 0
            self.pause = self.next_pause
            self.next_pause = min(MAX_PAUSE_STEPS, self.next_pause * 2)


@dataclass(slots=True)
class RowSpeculation:
    """One row's guessing state: its n-gram index and each source's record."""

    index: NgramIndex = field(default_factory=NgramIndex)
    ngram: GuessState = field(default_factory=GuessState)
    draft: GuessState = field(default_factory=GuessState)
    current: GuessSource = "ngram"  # where this step's guesses came from


@dataclass(slots=True)
class SpeculationCounts:
    """Engine totals: guesses made and accepted (all, and the draft model's), steps that
    verified any, and the draft model's forwards."""

    draft_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0
    model_draft_tokens: int = 0
    model_accepted_tokens: int = 0
    draft_forwards: int = 0


@dataclass(slots=True)
class _Candidate:
    row: ScheduledRow
    source: GuessSource
    tokens: list[int]  # n-gram guesses; a draft model's are made once chosen
    k: int
    state: GuessState


class Speculator:
    """Attaches drafts to a scheduled step (`plan`) and keeps each row's state."""

    def __init__(self, mode: SpeculateMode, exact: bool, draft: DraftModel | None = None) -> None:
        if mode not in SPECULATE_MODES:
            raise ValueError(f"speculate must be one of {', '.join(SPECULATE_MODES)}")
        if mode == "draft" and draft is None:
            mode = "none"  # the draft model itself, served on its own: nothing guesses for it
        self.mode: SpeculateMode = mode if exact else "none"
        self.draft = draft if self.mode in ("auto", "draft") else None
        self.counts = SpeculationCounts()
        self._rows: dict[int, RowSpeculation] = {}
        self.step_costs = StepCosts()  # a decode step's recent seconds, by token rows

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    def forget(self, seq_id: int) -> None:
        self._rows.pop(seq_id, None)
        if self.draft is not None:
            self.draft.forget(seq_id)

    def plan(
        self,
        out: SchedulerOutput,
        block_manager: BlockManager,
        budget: int,
        sampling_of: Callable[[Sequence], RowSamplingState] | None = None,
    ) -> bool:
        """Give some decode rows of `out` a draft (row.draft, row.num_tokens grown, their
        blocks appended); `budget` caps the step's tokens; `sampling_of` gives a row's sampler
        state (the draft model draws with it). Whether any row got one."""
        if not self.enabled or out.preempted or not out.rows:
            return False
        if any(not _decoding(row) for row in out.rows):
            return False
        candidates = [c for row in out.rows if (c := self._candidate(row, block_manager))]
        lanes = budget - len(out.rows)
        if self.mode == "auto":
            counts = self._worth_it(len(out.rows), candidates, lanes)
        else:
            counts = []
            for candidate in candidates:
                counts.append(min(candidate.k, max(0, lanes)))
                lanes -= counts[-1]
        chosen: list[tuple[_Candidate, int]] = []
        for candidate, count in zip(candidates, counts, strict=True):
            if count == 0:
                # Not worth it at the rate it had: drift back towards an untried row's, so a
                # row judged on a bad stretch gets another chance later.
                state = candidate.state
                state.rate += RATE_RECOVERY * (FIRST_RATE - state.rate)
            else:
                chosen.append((candidate, count))
        self._draft_guesses(chosen, sampling_of)
        planned = False
        for candidate, count in chosen:
            row = candidate.row
            # Rows before this one took blocks since its room was measured.
            room = block_manager.max_appendable(row.seq, 1 + count) - 1
            tokens = candidate.tokens[: max(0, min(count, room))]
            if not tokens:
                row.draft_probs = None
                continue
            block_manager.append_slots(row.seq, 1 + len(tokens))
            row.draft = tokens
            row.num_tokens = 1 + len(tokens)
            self._rows[row.seq.seq_id].current = candidate.source
            planned = True
        if planned:
            self.counts.verify_steps += 1
        return planned

    def _candidate(self, row: ScheduledRow, block_manager: BlockManager) -> _Candidate | None:
        """The row's guesses this step, if it may and wants to guess: its context's where it
        finds a match (and the mode allows), else the draft model's (made once chosen)."""
        seq = row.seq
        if not _may_guess(seq):
            return None
        state = self._rows.get(seq.seq_id)
        if state is None:
            state = self._rows[seq.seq_id] = RowSpeculation()
        # Never guess past max_tokens: the last position's bonus token is the last token; and
        # only into free blocks: a guess never preempts a row.
        room = seq.params.max_tokens - seq.num_generated_tokens - 1
        room = min(room, block_manager.max_appendable(seq, 1 + MAX_K) - 1)
        if room <= 0:
            return None
        if self.mode in ("auto", "ngram") and state.ngram.wants_to_guess():
            tokens = state.index.propose(seq.token_ids, min(state.ngram.k, room))
            if tokens:
                return _Candidate(row, "ngram", tokens, len(tokens), state.ngram)
        if self.draft is not None and state.draft.wants_to_guess():
            return _Candidate(row, "draft", [], min(state.draft.k, room), state.draft)
        return None

    def _draft_guesses(
        self,
        chosen: list[tuple[_Candidate, int]],
        sampling_of: Callable[[Sequence], RowSamplingState] | None,
    ) -> None:
        """Run the draft model for the chosen draft-model candidates, filling their tokens."""
        from modelhost.engine.draft_model import DraftRequest

        wanted = [(c, count) for c, count in chosen if c.source == "draft"]
        if not wanted or self.draft is None:
            return
        requests = []
        for candidate, count in wanted:
            seq = candidate.row.seq
            sampling = sampling_of(seq) if sampling_of is not None else None
            drawn = (
                sampling is not None
                and sampling.grammar is None
                and not seq.params.greedy
                and seq.params.seed is None
            )
            requests.append(DraftRequest(seq, count, sampling if drawn else None))
        before = self.draft.num_forwards
        guesses = self.draft.propose(requests)
        self.counts.draft_forwards += self.draft.num_forwards - before
        for (candidate, _), guess in zip(wanted, guesses, strict=True):
            candidate.tokens = guess.tokens
            candidate.row.draft_probs = guess.probs

    def _worth_it(self, num_rows: int, candidates: list[_Candidate], lanes: int) -> list[int]:
        """How many of each candidate's guesses to verify: the number that maximises the
        expected tokens a second. A guess at depth i of a row whose guesses land at rate p
        yields p ** i more tokens (it counts only if those before it landed), and a step of t
        token rows takes the least time such steps took lately (engine/step_costs.py: steady
        on a busy machine, where a step's time swings), or, for a size not seen lately, that
        of the dearest size seen below it: optimistic, so each size is tried and then judged
        by what it cost. Draft-model guesses add a forward of the draft per
        depth (its measured time; none until one ran)."""
        gains = sorted(
            (
                (-(candidate.state.rate ** (depth + 1)), index, depth)
                for index, candidate in enumerate(candidates)
                for depth in range(candidate.k)
            ),
        )[: max(0, lanes)]
        draft_s = self.draft.step_seconds if self.draft is not None else 0.0
        best, best_rate, tokens = 0, num_rows / self._step_seconds(num_rows), float(num_rows)
        draft_depth = 0
        for count, (gain, index, depth) in enumerate(gains, 1):
            tokens -= gain
            if candidates[index].source == "draft":
                draft_depth = max(draft_depth, depth + 1)
            rate = tokens / (self._step_seconds(num_rows + count) + draft_s * draft_depth)
            if rate > best_rate:
                best, best_rate = count, rate
        counts = [0] * len(candidates)
        for _, index, _ in gains[:best]:
            counts[index] += 1
        return counts

    def _step_seconds(self, num_tokens: int) -> float:
        return self.step_costs.seconds(num_tokens)

    def observe(self, out: SchedulerOutput, seconds: float) -> None:
        """Record how long a step took, forward, sampling and emitting, if it was a decode
        step (guesses or not)."""
        if not self.enabled or not out.rows:
            return
        if any(row.num_tokens != 1 + len(row.draft) or not _generated(row) for row in out.rows):
            return
        self.record_step(out.num_batched_tokens, seconds)

    def record_step(self, num_tokens: int, seconds: float) -> None:
        """A decode step of `num_tokens` token rows took `seconds`."""
        self.step_costs.record(num_tokens, seconds)

    def learn(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        counts = self.counts
        counts.draft_tokens += num_drafted
        counts.accepted_tokens += num_accepted
        state = self._rows.get(seq.seq_id)
        if state is None:
            return
        if state.current == "draft":
            counts.model_draft_tokens += num_drafted
            counts.model_accepted_tokens += num_accepted
            state.draft.learn(num_drafted, num_accepted)
        else:
            state.ngram.learn(num_drafted, num_accepted)


def exact_for(model: LoadedModel) -> bool:
    """Whether a verification step gives this model's decode logits bit for bit: every layer
    on the native kernels (the fused decode path describes them all), its KV pool one they read
    in place, and no longrope (whose table switches on a row's length within the step)."""
    import torch  # here: the serve command's arguments read this module's modes

    from modelhost.models.kernels import native

    network = model.network
    fused = getattr(network, "fused_decode", None)
    return (
        native.kernels() is not None
        and model.device.type == "cpu"
        and model.cache_dtype in (torch.float32, torch.float16)
        and getattr(network, "rotary_long", None) is None
        and fused is not None
        and fused() is not None
    )


def _decoding(row: ScheduledRow) -> bool:
    return row.num_tokens == 1 and _generated(row)


def _generated(row: ScheduledRow) -> bool:
    return row.samples and row.start >= row.seq.num_prompt_tokens


def _may_guess(seq: Sequence) -> bool:
    params = seq.params
    return params.speculate and not params.readout_token_ids
