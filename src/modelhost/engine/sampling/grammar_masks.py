"""Grammar-constrained rows: an xgrammar matcher per row, one token bitmask per step.

A row carries a grammar when its SamplingParams hold a compiled xgrammar grammar. Its matcher is
created with the row, masks the row's logits before every draw and accepts every sampled token;
once it has accepted a stop token (or the grammar admits nothing more) the row is done. A row
whose request carries a `ClosePlan` also has a `RowCloser`, which `steer`s each drawn token so
that the value closes within the row's budget (`grammar_close`).

xgrammar is imported only here and only when a grammar row exists, so a server that never sees
one never pays for the import (seconds) or for any per-step work.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from modelhost.engine.sampling.grammar_close import ClosePlan, RowCloser

log = logging.getLogger(__name__)


class GrammarState:
    """One row's position in its grammar."""

    __slots__ = ("matcher", "vocab_size", "failed", "closer")

    def __init__(self, compiled: Any, close_plan: ClosePlan | None = None) -> None:
        import xgrammar

        self.matcher = xgrammar.GrammarMatcher(compiled)
        self.vocab_size: int = compiled.tokenizer_info.vocab_size
        self.failed = False  # a token the grammar refused was sampled; the row must end
        self.closer = RowCloser(close_plan) if close_plan is not None else None

    @property
    def is_terminated(self) -> bool:
        return self.failed or self.matcher.is_terminated()

    @property
    def is_complete(self) -> bool:
        """What was accepted is a whole value of the grammar (a stop token may still follow)."""
        return not self.failed and (self.matcher.is_terminated() or self.matcher.is_completed())

    def steer(self, token_id: int, remaining: int) -> int:
        """The token to take instead of the drawn `token_id`, with `remaining` tokens left in
        the row's budget counting this one, so that the value still closes in budget."""
        if self.closer is None or self.is_terminated:
            return token_id
        try:
            return self.closer.steer(token_id, remaining, self.matcher)
        except Exception:  # a closing fault must cost this row its guarantee, not the step
            log.exception("closing failed; the row goes on without its guarantee")
            self.closer = None
            return token_id

    def accept(self, token_id: int) -> None:
        if self.matcher.is_terminated():
            return
        if self.closer is not None:
            try:
                self.closer.accept(token_id)
            except Exception:
                log.exception("closing failed; the row goes on without its guarantee")
                self.closer = None
        if not self.matcher.accept_token(token_id):
            # Only reachable when every allowed token was filtered out (e.g. a stop token id the
            # mask let through as the sole choice); ending the row beats emitting invalid output.
            log.warning("grammar rejected sampled token %d; ending the row", token_id)
            self.failed = True


def apply_masks(logits: torch.Tensor, states: Sequence[GrammarState | None]) -> None:
    """Set to -inf, in place, every logit a row's grammar forbids; rows with None are untouched.

    One bitmask covers the whole batch so the kernel can index rows directly; only the grammar
    rows are filled and masked.
    """
    import xgrammar

    rows = [i for i, state in enumerate(states) if state is not None and not state.is_terminated]
    if not rows:
        return
    vocab_size = max(states[i].vocab_size for i in rows)  # type: ignore[union-attr]
    bitmask = xgrammar.allocate_token_bitmask(logits.shape[0], vocab_size)
    for i in rows:
        states[i].matcher.fill_next_token_bitmask(bitmask, i)  # type: ignore[union-attr]
    covered = min(vocab_size, logits.shape[1])
    if logits.device.type == "cpu":
        xgrammar.apply_token_bitmask_inplace(
            logits, bitmask, vocab_size=covered, indices=rows, backend="cpu"
        )
    else:
        xgrammar.apply_token_bitmask_inplace(
            logits,
            bitmask.to(logits.device, non_blocking=True),
            vocab_size=covered,
            indices=rows,
            backend="torch_native",
        )
    if logits.shape[1] > covered:
        # Padding ids past the grammar's vocabulary are never valid output.
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        logits[index, covered:] = float("-inf")
