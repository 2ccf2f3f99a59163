"""The requests a server is answering and the ones it answered last, for the console's live view.

`ObservedRequests` (request_context.py) tells the app's `LiveFeed` when a request arrives and
when it ends; the protocol handler's `RequestLog` leaves on the request's context what it knows
as it goes (the admitted row: tokens and the first token's time) and at the end (the outcome).
Only requests that change something are kept (every method but GET, HEAD and OPTIONS): the
page's own reads, probes and scrapes would push the answers out.

A request a worker process answers is observed there too, under the same `x-request-id`: the
worker's feed is read over its socket (`GET /admin/requests`) while a row of its model waits
for them, and its token figures are kept on the front's row (`LiveFeed.fill`; a row still in
flight gets them as they stand, `merge_worker_rows`).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from modelhost.server.edge.request_context import RequestContext

KEPT_FINISHED = 50
ASK_WORKERS_S = 10.0  # how long after its end a row may still wait for a worker's figures
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
TOKEN_FIELDS = ("prompt_tokens", "completion_tokens", "ttft_ms", "tok_s")


def observed(method: str) -> bool:
    return method not in READ_METHODS


class LiveFeed:
    """Requests in flight and the last `keep` finished; `changed()` wakes a watcher on either."""

    def __init__(self, keep: int = KEPT_FINISHED) -> None:
        self.in_flight: OrderedDict[int, RequestContext] = OrderedDict()
        self.finished: deque[dict[str, Any]] = deque(maxlen=keep)
        self.version = 0
        self.closed = False  # the server is shutting down: watchers end their streams
        self._waiters: set[asyncio.Future[None]] = set()

    def started(self, context: RequestContext) -> None:
        if observed(context.method):
            self.in_flight[id(context)] = context
            self._bump()

    def ended(self, context: RequestContext, status: int) -> None:
        if self.in_flight.pop(id(context), None) is None:
            return
        row = {**row_of(context, time.monotonic()), "status": status, "ended": time.time()}
        self.finished.appendleft(row)
        self._bump()

    def rows(self) -> list[dict[str, Any]]:
        """In flight (oldest first), then finished (newest first)."""
        now = time.monotonic()
        return [row_of(context, now) for context in self.in_flight.values()] + list(self.finished)

    def awaiting_figures(self, within_s: float = ASK_WORKERS_S) -> set[str]:
        """The models whose rows (in flight, or ended in the last `within_s`) have no token
        figures yet: a worker process may have them."""
        now = time.time()
        return {
            row["model"]
            for row in self.rows()
            if row["model"] and row["completion_tokens"] is None
            and (row["in_flight"] or now - row["ended"] < within_s)
        }  # fmt: skip

    def fill(self, worker_rows: Iterable[Mapping[str, Any]]) -> None:
        """Keep the token figures a worker reported on the finished rows of the same id."""
        by_id = {row.get("id"): row for row in worker_rows}
        for row in self.finished:
            theirs = by_id.get(row["id"])
            if theirs is not None and row["completion_tokens"] is None:
                row.update({key: theirs.get(key) for key in TOKEN_FIELDS})

    async def changed(self, seen: int, timeout_s: float) -> int:
        """The version once it differs from `seen`, or after `timeout_s`, whichever is first."""
        if self.version == seen:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.add(waiter)
            try:
                await asyncio.wait_for(waiter, timeout_s)
            except TimeoutError:
                pass
            finally:
                self._waiters.discard(waiter)
        return self.version

    def close(self) -> None:
        """End every watcher's wait, for good: a shutting-down server waits for no console."""
        self.closed = True
        self._bump()

    def _bump(self) -> None:
        self.version += 1
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)


def row_of(context: RequestContext, now: float) -> dict[str, Any]:
    """One request as the live view shows it; token figures are None until known."""
    row: dict[str, Any] = {
        "id": context.request_id,
        "method": context.method,
        "route": context.path,
        "model": context.model,
        "status": context.status,
        "in_flight": context.ended_at is None,
        "started": context.started_wall,
        "total_ms": round(((context.ended_at or now) - context.arrived_at) * 1000, 1),
        **dict.fromkeys(TOKEN_FIELDS),
    }
    outcome, admitted = context.outcome, context.admitted
    if outcome is not None:
        row["prompt_tokens"] = outcome.prompt_tokens
        row["completion_tokens"] = outcome.completion_tokens
        if outcome.ttft_s is not None:
            row["ttft_ms"] = round(outcome.ttft_s * 1000, 1)
        if outcome.token_gap_s:
            row["tok_s"] = round(1 / outcome.token_gap_s, 1)
    elif admitted is not None:  # still generating: the figures so far
        row["prompt_tokens"] = admitted.prompt_tokens
        row["completion_tokens"] = admitted.completion_tokens
        first = admitted.first_token_at
        if first is not None:
            row["ttft_ms"] = round((first - context.arrived_at) * 1000, 1)
            if admitted.completion_tokens > 1 and now > first:
                row["tok_s"] = round((admitted.completion_tokens - 1) / (now - first), 1)
    return row


def merge_worker_rows(
    rows: list[dict[str, Any]], worker_rows: Iterable[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """`rows` with the token figures a worker reported for the same request id filled in."""
    by_id = {row.get("id"): row for row in worker_rows}
    merged = []
    for row in rows:
        theirs = by_id.get(row["id"])
        if theirs is not None and row["completion_tokens"] is None:
            row = {**row, **{key: theirs.get(key) for key in TOKEN_FIELDS}}
        merged.append(row)
    return merged
