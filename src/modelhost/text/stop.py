"""Stop strings matched on decoded text, with hold-back so a stop string is never shown.

Text arrives in deltas that can split a stop string anywhere. The matcher emits everything that can
no longer turn out to be the start of a stop string and holds back the longest tail that still
could; `flush` releases that tail when generation ends for another reason.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(dict.fromkeys(s for s in stops if s))
        # Every proper prefix of every stop string: the tails worth holding back.
        self._prefixes = frozenset(s[:i] for s in self._stops for i in range(1, len(s)))
        self._max_held = max((len(s) - 1 for s in self._stops), default=0)
        self._pending = ""
        self._matched: str | None = None

    @property
    def matched(self) -> str | None:
        """The stop string that ended the text, once one has."""
        return self._matched

    def push(self, text: str) -> tuple[str, str | None]:
        """Take a delta; return the text safe to show now and the stop string if one matched.

        Once a stop string has matched, the text from it on is dropped and every later push
        returns ("", that stop string).
        """
        if self._matched is not None:
            return "", self._matched
        if not self._stops:
            return text, None
        pending = self._pending + text

        # Hold-back guarantees no match starts in text already emitted, so searching `pending`
        # alone finds every match; the earliest start wins, then the first listed.
        earliest = -1
        for stop in self._stops:
            index = pending.find(stop)
            if index != -1 and (earliest == -1 or index < earliest):
                earliest, self._matched = index, stop
        if self._matched is not None:
            self._pending = ""
            return pending[:earliest], self._matched

        held = self._held_length(pending)
        self._pending = pending[len(pending) - held :]
        return pending[: len(pending) - held], None

    def flush(self) -> str:
        """Release held-back text at the end of generation ("" once a stop string matched)."""
        text, self._pending = self._pending, ""
        return text if self._matched is None else ""

    def _held_length(self, pending: str) -> int:
        for length in range(min(len(pending), self._max_held), 0, -1):
            if pending[-length:] in self._prefixes:
                return length
        return 0
