"""What the residency host deals in: servable entries, loaded units, and its typed refusals."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol


class ResidencyError(Exception):
    """A model that cannot be leased. `code`: does-not-fit, load-failed, closed, in-use,
    not-switchable, already-resident, wrong-operation."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


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


class Unit(Protocol):
    """A loaded model: an in-process engine or a worker process."""

    resumed: bool  # saved state was found at load

    def measured_bytes(self) -> int | None: ...  # None before its first reading
    async def refresh(self) -> None: ...  # take a current reading (a worker's GET /health)
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
    operations: tuple[str, ...] = field(default=())
    role: str = "primary"


class Pause:
    """Returned by `pause_all`; `dispose()` resumes the units and lets loads go on (idempotent)."""

    def __init__(self, dispose: Callable[[], None]) -> None:
        self._dispose: Callable[[], None] | None = dispose

    def dispose(self) -> None:
        dispose, self._dispose = self._dispose, None
        if dispose is not None:
            dispose()
