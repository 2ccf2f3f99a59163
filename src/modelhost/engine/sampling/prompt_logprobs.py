"""Prompt logprobs: how well the model predicted each token of a prompt (perplexity, `echo`).

A row whose SamplingParams set `prompt_logprobs` gets logits at every prompt position it
computes, not just its last: the runner appends those positions to the step's logits index,
after the sampling rows, and the engine scores them here. Logits at position p score prompt
token p + 1; the first prompt token has no context, so its entry carries NaN (the wire writes
null). Such a row never reuses cached prefix blocks, since skipped positions have no logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from modelhost.engine.events import TokenLogprob, TopLogprob
from modelhost.engine.scheduler import ScheduledRow
from modelhost.engine.sequence import Sequence
from modelhost.text.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class PromptSpan:
    """Prompt positions `first`..`first + count - 1` of one row, computed this step."""

    row: ScheduledRow
    flat_start: int  # index of position `first` among the step's flattened tokens
    first: int
    count: int


def prompt_spans(rows: list[ScheduledRow]) -> list[PromptSpan]:
    spans: list[PromptSpan] = []
    flat = 0
    for row in rows:
        seq = row.seq
        if seq.params.prompt_logprobs:
            # Positions up to the one before the last prompt token: the last one's logits
            # predict the first generated token, which the sampler reports.
            end = min(row.start + row.num_tokens, seq.num_prompt_tokens - 1)
            if end > row.start:
                spans.append(PromptSpan(row, flat, row.start, end - row.start))
        flat += row.num_tokens
    return spans


def prompt_logits_index(rows: list[ScheduledRow]) -> list[int]:
    """Flat token indices whose logits the prompt-logprob rows need, in span order."""
    return [span.flat_start + i for span in prompt_spans(rows) for i in range(span.count)]


class PromptScores:
    """Each prompt-logprob row's entries so far, by seq id, until its first token is emitted."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._entries: dict[int, list[TokenLogprob]] = {}

    def add(self, spans: list[PromptSpan], logits: torch.Tensor) -> None:
        """Score `spans` from their logits (rows of `logits`, in span order)."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        at = 0
        for span in spans:
            seq = span.row.seq
            entries = self._entries.setdefault(seq.seq_id, [])
            if not entries:
                first = seq.token_ids[0]
                entries.append(TokenLogprob(first, self._piece(first), math.nan))
            top_n = seq.params.logprobs or 0
            for i in range(span.count):
                position = span.first + i
                if position + 1 == len(entries):  # a recomputed position is scored once
                    entries.append(
                        self._entry(logprobs[at + i], seq.token_ids[position + 1], top_n)
                    )
            at += span.count

    def pop(self, seq: Sequence) -> list[TokenLogprob]:
        """The row's entries, forgotten here; a one-token prompt has only its first entry."""
        entries = self._entries.pop(seq.seq_id, None)
        if entries is None:
            first = seq.token_ids[0]
            entries = [TokenLogprob(first, self._piece(first), math.nan)]
        return entries

    def forget(self, seq_id: int) -> None:
        self._entries.pop(seq_id, None)

    def _entry(self, row: torch.Tensor, token_id: int, top_n: int) -> TokenLogprob:
        top: tuple[TopLogprob, ...] = ()
        if top_n:
            values, ids = row.topk(top_n)
            top = tuple(
                TopLogprob(int(t), self._piece(int(t)), float(v))
                for v, t in zip(values.tolist(), ids.tolist(), strict=True)
            )
        return TokenLogprob(token_id, self._piece(token_id), float(row[token_id]), top)

    def _piece(self, token_id: int) -> str:
        return self.tokenizer.id_to_piece(token_id)
