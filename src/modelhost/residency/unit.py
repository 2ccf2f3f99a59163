"""What the residency host deals in: servable entries, loaded units, and its typed refusals."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

log = logging.getLogger("modelhost.models")


class ResidencyError(Exception):
    """A model that cannot be leased. `code`: does-not-fit, load-failed, closed, in-use,
    not-switchable, already-resident, wrong-operation, unsupported-model, unknown-model."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class LoadProgress:
    """How far a model's load has got: the loader reports the fraction of its weights read (from
    any thread); the host shows it while the model is loading, and each tenth is told (`say`,
    with the percent; by default a log line) once a load has taken more than a moment."""

    LOG_AFTER_S = 2.0
    LOG_MESSAGE = "[models] %s loading: %d%%"

    def __init__(
        self,
        model_id: str = "",
        clock: Callable[[], float] = time.monotonic,
        say: Callable[[int], None] | None = None,
    ) -> None:
        self.model_id = model_id
        self.fraction: float | None = None
        self._clock = clock
        self._say = say or self._log
        self._started = clock()
        self._told_tenths = 0

    def report(self, fraction: float) -> None:
        self.fraction = min(1.0, max(0.0, fraction))
        tenths = int(self.fraction * 10)
        if tenths > self._told_tenths and self._clock() - self._started >= self.LOG_AFTER_S:
            self._told_tenths = tenths
            self._say(10 * tenths)

    def _log(self, percent: int) -> None:
        log.info(self.LOG_MESSAGE, self.model_id, percent)


class Servable(Protocol):
    """What the host needs to know about a model before loading it (a registry ModelEntry)."""

    @property
    def id(self) -> str: ...
    @property
    def estimate_bytes(self) -> int: ...
    @property
    def weights_bytes(self) -> int: ...
    @property
    def operations(self) -> Sequence[str]: ...
    # What admitted requests may claim beyond the estimate (a KV pool that grows with use):
    # one step's working memory, a full context of KV a row, the pool's ceiling for all rows,
    # and the bound of the KV store writer's queue (blocks copied out of the pool as rows
    # commit them; 0 with the store off).
    @property
    def work_bytes(self) -> int: ...
    @property
    def kv_row_bytes(self) -> int: ...
    @property
    def kv_pool_bytes(self) -> int: ...
    @property
    def store_queue_bytes(self) -> int: ...


def claim_bytes(entry: Servable, rows: int) -> int:
    """What `rows` admitted requests on a model may still claim beyond what it holds idle: one
    step's working memory and a full context of KV for each row, never more than the pool's
    ceiling (the engine grows its pool no further), and the KV store writer's queue, which
    only running rows fill (what it still holds once they end is in the unit's measurement).
    Zero for a model whose estimate already holds everything (a preallocated pool, a
    companion)."""
    if rows <= 0:
        return 0
    kv = min(entry.kv_pool_bytes, rows * entry.kv_row_bytes)
    return entry.work_bytes + kv + entry.store_queue_bytes


class Unit(Protocol):
    """A loaded model: an in-process engine or a worker process."""

    resumed: bool  # saved state was found at load

    def measured_bytes(self) -> int | None: ...  # None before its first reading
    async def refresh(self) -> None: ...  # take a current reading (a worker's GET /health)
    # Give back what it keeps only for its next request (its KV pool), when idle; the host
    # asks before it evicts anything for room.
    async def give_back_idle_memory(self) -> None: ...
    def broken(self) -> bool: ...
    def pause(self) -> None: ...
    def resume(self) -> None: ...
    async def close(self) -> bool: ...  # drain, flush, release; True when the flush was durable


@dataclass(frozen=True, slots=True)
class ResidentModel:
    id: str
    state: str
    bytes: int
    pinned: bool
    leases: int
    last_used_at: float
    hold_s: float = 0.0  # held this long after its last response (a keep-alive, or the host's)
    operations: tuple[str, ...] = field(default=())
    role: str = "primary"
    progress: float | None = None  # while loading: the fraction of its weights read
    node: str | None = None  # in a cluster: the node that holds it


class Pause:
    """Returned by `pause_all`; `dispose()` resumes the units and lets loads go on (idempotent)."""

    def __init__(self, dispose: Callable[[], None]) -> None:
        self._dispose: Callable[[], None] | None = dispose

    def dispose(self) -> None:
        dispose, self._dispose = self._dispose, None
        if dispose is not None:
            dispose()
