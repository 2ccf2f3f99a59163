"""Draft-model guesses: a small model with the target's tokenizer runs k steps ahead of each
speculating row, and the target verifies its guesses in one step (engine/speculation.py).

Each row the draft serves has a mirror here: a `Sequence` over the draft's own paged KV pool
(its own `BlockManager` and `ModelRunner`), holding the row's tokens followed by the guesses of
its last draft. Before drafting, the mirror is synced to the row: tokens the target kept stay
computed, the KV of guesses it rejected is rolled back (blocks past the kept tokens go back to
the pool, as the target's do), and the tokens the draft has not seen yet (a new row's prompt,
the accepted guesses' bonus token) are computed in the draft's first forward, which also gives
the first guess. Every further guess is a one-token decode step of the draft over all the rows
drafting. A row that ends frees its mirror (`forget`).

A greedy row's guess is the draft's best token: the target keeps it when its own choice is the
same, so the answer is the one plain decoding gives. A row that samples without a seed draws
each guess from the draft's distribution q (the row's temperature and filters applied to the
draft's logits) and keeps q for speculative sampling (sampling/speculative_sampling.py); a
seeded row guesses the draft's best token too, and keeps the tokens its seed gives without
speculation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from modelhost.engine.kv.block_manager import BlockManager
from modelhost.engine.kv.kv_memory import grows_on
from modelhost.engine.runner import ModelRunner
from modelhost.engine.sampling.sampler import RowSamplingState, probabilities
from modelhost.engine.sampling.sampling_params import SamplingParams
from modelhost.engine.sampling.speculative_sampling import draw_from
from modelhost.engine.scheduler import ScheduledRow, SchedulerOutput
from modelhost.engine.sequence import Sequence
from modelhost.engine.step_costs import StepCosts
from modelhost.models.loaded import LoadedModel

CATCH_UP_CHUNK = 512  # tokens of a row the draft computes per forward before its first guess


class DraftMismatch(ValueError):
    """The draft model cannot guess for this target: their tokenizers differ."""


def check_same_tokenizer(target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse a draft whose token ids do not mean the target's tokens (DraftMismatch)."""
    target_vocab = target.tokenizer.backend.get_vocab()
    draft_vocab = draft.tokenizer.backend.get_vocab()
    if target_vocab != draft_vocab:
        raise DraftMismatch(
            f"draft model {draft.id} cannot guess for {target.id}: their tokenizers differ "
            f"({len(draft_vocab)} and {len(target_vocab)} tokens, or the same count with "
            "different ids); a draft model needs the target's tokenizer"
        )


@dataclass(slots=True)
class DraftRequest:
    """One row's ask: up to `k` guesses; `sampling` set when they are drawn (speculative
    sampling), None for the draft's best tokens."""

    seq: Sequence
    k: int
    sampling: RowSamplingState | None = None


@dataclass(slots=True)
class DraftGuess:
    tokens: list[int]
    # [len(tokens), target vocab]: the distribution each guess was drawn from; None for best tokens.
    probs: torch.Tensor | None = None


class _Mirror:
    __slots__ = ("generator", "seq", "synced")

    def __init__(self, seq: Sequence) -> None:
        self.seq = seq
        self.synced = seq.num_tokens  # tokens before this are the row's own
        self.generator: torch.Generator | None = None


class DraftModel:
    """The draft model beside one engine's target: its KV pool and its rows' mirrors."""

    def __init__(
        self,
        model: LoadedModel,
        *,
        target_vocab_size: int,
        num_blocks: int,
        block_size: int,
        prompt_threads: int | None = None,
    ) -> None:
        self.model = model
        self.vocab_size = target_vocab_size
        grows = grows_on(model.device)
        self.block_manager = BlockManager(num_blocks, block_size, grows=grows)
        self.runner = ModelRunner(
            model,
            num_blocks=num_blocks,
            block_size=block_size,
            prompt_threads=prompt_threads,
            grows=grows,
        )
        self._mirrors: dict[int, _Mirror] = {}
        self._costs = StepCosts()  # the draft's forwards, all as one size (step_costs.py)
        self.num_forwards = 0

    @property
    def step_seconds(self) -> float:
        """What one draft forward costs lately (its least recent time); 0 until one ran."""
        return self._costs.known(1) or 0.0

    def forget(self, seq_id: int) -> None:
        """The row ended: its mirror's blocks go back to the draft's pool."""
        mirror = self._mirrors.pop(seq_id, None)
        if mirror is not None:
            self.block_manager.free(mirror.seq)

    def give_back(self, keep_blocks: int) -> None:
        """An idle engine returns the draft pool's memory above `keep_blocks` too."""
        first = self.block_manager.release_tail(keep_blocks)
        if first is not None:
            self.runner.release_blocks_from(first)

    def propose(self, requests: list[DraftRequest]) -> list[DraftGuess]:
        """Up to k guesses for each request's row (fewer, maybe none, where the draft's pool
        has no room), computed together."""
        guesses = [DraftGuess([]) for _ in requests]
        active: list[tuple[int, _Mirror, int]] = []  # (request index, mirror, its k)
        for index, request in enumerate(requests):
            mirror = self._synced(request.seq)
            if mirror is None:
                continue
            seq = mirror.seq
            if seq.num_tokens + request.k > self.model.context_length:
                continue  # past the draft's own window
            new = seq.num_tokens - seq.num_computed_tokens
            k = min(
                request.k, self.block_manager.max_appendable(seq, new + request.k - 1) - new + 1
            )
            if k < 1:
                continue
            self.block_manager.append_slots(seq, new + k - 1)
            if request.sampling is not None:
                if mirror.generator is None:
                    mirror.generator = torch.Generator()
                    mirror.generator.seed()
                guesses[index].probs = torch.empty(k, self.vocab_size)
            active.append((index, mirror, k))
        if not active:
            return guesses
        self._catch_up([mirror for _, mirror, _ in active])
        depth = 0
        while active:
            rows = [
                ScheduledRow(
                    m.seq, m.seq.num_computed_tokens, m.seq.num_tokens - m.seq.num_computed_tokens,
                    samples=True,
                )
                for _, m, _ in active
            ]  # fmt: skip
            logits = self._forward(rows)[:, : self.vocab_size]
            still: list[tuple[int, _Mirror, int]] = []
            for i, (index, mirror, k) in enumerate(active):
                row_logits = logits[i : i + 1]
                guess = guesses[index]
                sampling = requests[index].sampling
                if sampling is None or guess.probs is None:
                    token = int(row_logits.argmax(dim=-1))
                else:
                    q = probabilities(row_logits.clone(), [sampling])[0]
                    guess.probs[depth].zero_()
                    guess.probs[depth, : q.shape[0]] = q
                    token = draw_from(guess.probs[depth], mirror.generator)
                guess.tokens.append(token)
                seq = mirror.seq
                seq.num_computed_tokens = seq.num_tokens
                seq.append_token(token)
                if len(guess.tokens) < k:
                    still.append((index, mirror, k))
            active = still
            depth += 1
        return guesses

    def _synced(self, row: Sequence) -> _Mirror | None:
        """The row's mirror, its tokens the row's: KV of tokens the target rejected rolled back.
        None when the draft's pool cannot take a new row's prompt."""
        mirror = self._mirrors.get(row.seq_id)
        manager = self.block_manager
        if mirror is None:
            seq = Sequence(row.seq_id, list(row.token_ids), row.num_prompt_tokens, _MIRROR)
            if not manager.can_allocate_prompt(seq):
                return None
            manager.allocate_prompt(seq)
            mirror = self._mirrors[row.seq_id] = _Mirror(seq)
            return mirror
        seq, tokens = mirror.seq, row.token_ids
        valid = mirror.synced
        limit = min(seq.num_computed_tokens, len(tokens), seq.num_tokens)
        while valid < limit and seq.token_ids[valid] == tokens[valid]:
            valid += 1
        del seq.token_ids[valid:]
        seq.token_ids.extend(tokens[valid:])
        seq.num_computed_tokens = min(seq.num_computed_tokens, valid)
        mirror.synced = len(tokens)
        manager.trim(seq)
        manager.commit_full_blocks(seq)
        return mirror

    def _catch_up(self, mirrors: list[_Mirror]) -> None:
        """Compute all but the last CATCH_UP_CHUNK unseen tokens of rows that have more (a
        long prompt), a chunk a forward, so the first guess's forward stays small."""
        while True:
            rows = [
                ScheduledRow(m.seq, m.seq.num_computed_tokens, CATCH_UP_CHUNK, samples=False)
                for m in mirrors
                if m.seq.num_tokens - m.seq.num_computed_tokens > CATCH_UP_CHUNK
            ]
            if not rows:
                return
            self._forward(rows)
            for row in rows:
                row.seq.num_computed_tokens += row.num_tokens

    def _forward(self, rows: list[ScheduledRow]) -> torch.Tensor:
        started = time.perf_counter()
        logits = self.runner.execute(SchedulerOutput(rows=rows))
        seconds = time.perf_counter() - started
        self.num_forwards += 1
        self._costs.record(1, seconds)
        return logits


_MIRROR = SamplingParams(temperature=0.0)  # a mirror's params: read only by the prefix cache
