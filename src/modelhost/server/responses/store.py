"""The Responses API's memory of past answers, for `previous_response_id` and `GET`.

The front server's (a worker process keeps an answer only until the front takes it:
`responses_forwarding`), and bounded two ways: an entry expires `ttl_s` after it was stored,
and the store drops least-recently-used entries while its size is over `max_bytes` (an entry's
size is the length of its JSON). Nothing survives a restart of the server, as with the
reference server; everything survives a model's eviction or a worker's respawn.

A response the front is still relaying is *expected*: a lookup of its id waits (a little) for
it to be stored, or not, so a client that chains a turn the moment it has read the last one
never races the front.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

DEFAULT_TTL_S = 3600.0
DEFAULT_MAX_BYTES = 32 * 1024 * 1024
SETTLE_TIMEOUT_S = 10.0  # the front takes an answer from its worker in milliseconds


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """What a later turn needs: the input items, the output items, the instructions, and the
    response object itself (for `GET /v1/responses/{id}`)."""

    input_items: Sequence[Mapping[str, Any]]
    output_items: Sequence[Mapping[str, Any]]
    instructions: str | None
    response: Mapping[str, Any]

    @property
    def num_bytes(self) -> int:
        parts = (self.input_items, self.output_items, self.instructions, self.response)
        return sum(len(json.dumps(part, ensure_ascii=False)) for part in parts)

    def to_json(self) -> dict[str, Any]:
        return {
            "input_items": list(self.input_items),
            "output_items": list(self.output_items),
            "instructions": self.instructions,
            "response": dict(self.response),
        }

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> StoredResponse:
        return cls(
            list(value["input_items"]),
            list(value["output_items"]),
            value["instructions"],
            dict(value["response"]),
        )


@dataclass(frozen=True, slots=True)
class ResponseStoreStats:
    entries: int
    num_bytes: int
    max_bytes: int
    ttl_s: float


class ResponseStore:
    def __init__(
        self,
        *,
        ttl_s: float = DEFAULT_TTL_S,
        max_bytes: int = DEFAULT_MAX_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.clock = clock
        self._entries: OrderedDict[str, tuple[float, int, StoredResponse]] = OrderedDict()
        self._num_bytes = 0
        self._expected: dict[str, asyncio.Event] = {}

    def put(self, response_id: str, entry: StoredResponse) -> bool:
        """Keep `entry`; False when it alone is over the byte cap (nothing is kept then)."""
        size = entry.num_bytes
        self._drop(response_id)
        if size > self.max_bytes:
            return False
        self._entries[response_id] = (self.clock(), size, entry)
        self._num_bytes += size
        while self._num_bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
        self.check_invariants()
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry, now the most recently used; None when unknown or expired."""
        found = self._entries.get(response_id)
        if found is None:
            return None
        stored_at, _, entry = found
        if self.clock() - stored_at >= self.ttl_s:
            self._drop(response_id)
            return None
        self._entries.move_to_end(response_id)
        return entry

    def take(self, response_id: str) -> StoredResponse | None:
        """The entry, removed from the store (a worker's answer, which the front keeps)."""
        entry = self.get(response_id)
        self._drop(response_id)
        return entry

    def expect(self, response_id: str) -> None:
        """`response_id` is being answered: lookups wait until `settle` says it is stored or
        will not be."""
        self._expected.setdefault(response_id, asyncio.Event())

    def settle(self, response_id: str) -> None:
        expected = self._expected.pop(response_id, None)
        if expected is not None:
            expected.set()

    async def get_settled(
        self, response_id: str, timeout_s: float = SETTLE_TIMEOUT_S
    ) -> StoredResponse | None:
        """`get`, once a response still being answered under that id has been settled."""
        expected = self._expected.get(response_id)
        if expected is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(expected.wait(), timeout_s)
        return self.get(response_id)

    def stats(self) -> ResponseStoreStats:
        return ResponseStoreStats(len(self._entries), self._num_bytes, self.max_bytes, self.ttl_s)

    def check_invariants(self) -> None:
        assert self._num_bytes == sum(size for _, size, _ in self._entries.values())
        assert self._num_bytes <= self.max_bytes

    def _drop(self, response_id: str) -> None:
        found = self._entries.pop(response_id, None)
        if found is not None:
            self._num_bytes -= found[1]
