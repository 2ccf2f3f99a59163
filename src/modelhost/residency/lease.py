"""A lease: one request's hold on a resident model, released exactly once.

While a model has a lease it is never evicted. The router releases the lease when the response
body ends, is cancelled or fails (`async with lease:` or `release()` in a `finally`); releasing
twice is harmless, so every path that might end a request can release without bookkeeping.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import Generic, TypeVar

U = TypeVar("U")


class Lease(Generic[U]):
    def __init__(self, model_id: str, unit: U, on_release: Callable[[], None]) -> None:
        self.model_id = model_id
        self.unit = unit
        self._on_release: Callable[[], None] | None = on_release

    @property
    def released(self) -> bool:
        return self._on_release is None

    def release(self) -> None:
        on_release, self._on_release = self._on_release, None
        if on_release is not None:
            on_release()

    async def __aenter__(self) -> Lease[U]:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()
