"""Prompt-lookup drafts: guess a row's next tokens from where its last tokens appeared before.

A row that copies from its context (code shown back with a rename, a quoted document, a JSON
schema's keys) repeats n-grams it has already seen; the tokens that followed the most recent
earlier occurrence of its last n tokens are a cheap guess of what comes next. `NgramIndex`
keeps, for each n in [min_n, max_n], the position after the latest occurrence of every n-gram
of the row's tokens, extended as tokens arrive (a row's tokens only ever grow: rejected
guesses never enter them), so a lookup is a few dictionary reads whatever the context length.

Pure Python: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

MIN_N = 2  # a single repeated token guesses too often and too badly
MAX_N = 4


class NgramIndex:
    """One row's n-gram positions; `propose` reads the row's token list as it is now."""

    __slots__ = ("_follows", "_indexed", "max_n", "min_n")

    def __init__(self, min_n: int = MIN_N, max_n: int = MAX_N) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        self.min_n, self.max_n = min_n, max_n
        # (n-gram) -> the position right after its latest occurrence that has a follower
        self._follows: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this position are in `_follows`

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest tail
        n-gram (max_n down to min_n) seen before; [] when none was."""
        if k <= 0:
            return []
        self._extend(tokens)
        end = len(tokens)
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            start = self._follows.get(tuple(tokens[end - n :]))
            if start is not None:
                return list(tokens[start : min(start + k, end)])
        return []

    def _extend(self, tokens: Sequence[int]) -> None:
        # Index every n-gram that ends before the last token, i.e. that has a follower: the
        # tail itself is what a lookup asks for, and must find an *earlier* occurrence.
        last = len(tokens) - 1
        follows = self._follows
        for stop in range(max(self._indexed, 1), last + 1):
            for n in range(self.min_n, self.max_n + 1):
                if stop - n < 0:
                    break
                follows[tuple(tokens[stop - n : stop])] = stop
        self._indexed = max(self._indexed, last + 1)
