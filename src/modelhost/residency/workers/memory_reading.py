"""A process's memory as last read, so that leasing a resident model never waits on /proc.

A PSS reading (`/proc/PID/smaps_rollup`) walks the process's page tables: 4-5 ms for a model's
worker or the fork server on a 2-core machine, more under load. The residency host reads what a
resident holds and what the spare and the fork server hold on every lease of a resident model,
three readings that were ~13 ms of a cached short prompt's first token (issue 48). The lease takes
the last reading instead; one older than `max_age_s` is taken again in a thread meanwhile (the
file read lets go of the GIL), and a load's decision takes current ones (`now`).

How stale a reading may be does not loosen the budget: what a lease may add (its rows' KV, one
step's working memory) is counted as its claim on top of the reading, so a reading taken before
a burst under-counts nothing the claims do not cover, and one taken during it over-counts.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("modelhost.models")

READING_MAX_AGE_S = 1.0


class LastReading:
    """`read()` (bytes, None: nothing to read) as last taken; see the module's docstring."""

    def __init__(
        self,
        read: Callable[[], int | None],
        max_age_s: float = READING_MAX_AGE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._read = read
        self.max_age_s = max_age_s
        self._clock = clock
        self._value: int | None = None
        self._taken_at: float | None = None  # None: never read
        self._reading: threading.Thread | None = None

    def now(self) -> int | None:
        """A current reading, taken here (blocking: call it in a thread on an event loop)."""
        value = self._read()
        self._value, self._taken_at = value, self._clock()
        return value

    def last(self) -> int | None:
        """The last reading, at once; the first is taken here, a stale one again in a thread."""
        if self._taken_at is None:
            return self.now()
        stale = self._clock() - self._taken_at > self.max_age_s
        if stale and (self._reading is None or not self._reading.is_alive()):
            self._reading = threading.Thread(
                target=self._read_in_background, name="memory-reading", daemon=True
            )
            self._reading.start()
        return self._value

    def _read_in_background(self) -> None:
        try:
            self.now()
        except Exception:  # a process closed under the reading (a shutdown): the last one stands
            log.debug("a memory reading failed", exc_info=True)
