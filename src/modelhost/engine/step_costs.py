"""What a step of t token rows costs lately: the figure speculation weighs guesses against.

A step's wall time on a machine shared with other work swings by several times from one step
to the next (a kernel thread preempted, a neighbour's burst); a running average of it follows
the swings, and a cost model fed with it guesses wildly on one step and not at all on the
next (measured: a 1-row step averaging 85 ms beside 33 ms for 2 rows, where alone they take
about 10 and 11). The least time of a size's recent steps is what that size costs when nothing
gets in its way, and a ratio of two such figures is steady under load: that is what `seconds`
gives. A size's times expire after STALE_STEPS steps, so a size judged on a stretch when the
machine was busy is tried again (a size not seen reads as the dearest size seen below it).

Pure Python: no torch.
"""

from __future__ import annotations

from collections import deque

RECENT = 8  # times kept per size
STALE_STEPS = 256  # steps after which a size's times no longer count


class StepCosts:
    """Recent step times by number of token rows; `seconds(t)` reads what a step of t costs."""

    __slots__ = ("_clock", "_times")

    def __init__(self) -> None:
        self._times: dict[int, deque[tuple[int, float]]] = {}
        self._clock = 0  # steps recorded so far

    def record(self, size: int, seconds: float) -> None:
        """A step of `size` token rows took `seconds`."""
        self._clock += 1
        times = self._times.get(size)
        if times is None:
            times = self._times[size] = deque(maxlen=RECENT)
        times.append((self._clock, seconds))

    def known(self, size: int) -> float | None:
        """The least recent time of a step of `size` rows, or None when none is recent."""
        times = self._times.get(size)
        if not times:
            return None
        oldest = self._clock - STALE_STEPS
        while times and times[0][0] <= oldest:
            times.popleft()
        return min(seconds for _, seconds in times) if times else None

    def seconds(self, size: int, unseen: float = 1.0) -> float:
        """What a step of `size` rows costs: its own least recent time, or for a size not seen
        lately the dearest size seen below it (optimistic: each size is tried, then judged by
        what it cost), or `unseen` when none was."""
        own = self.known(size)
        if own is not None:
            return own
        below = [s for other in self._times if other < size and (s := self.known(other))]
        return max(below) if below else unseen

    def snapshot(self) -> dict[int, float]:
        """Each size's figure now (for a look from outside: tests, a profile)."""
        return {size: s for size in sorted(self._times) if (s := self.known(size)) is not None}
