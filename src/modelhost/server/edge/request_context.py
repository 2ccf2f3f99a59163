"""One request as the edge sees it: its id, its context, and the layer that gives every request
both, counts it and writes its log line when no handler did.

`ObservedRequests` is the outermost layer of every app. It gives each request an id (the
client's own `x-request-id` when it is sane, else a new one), carries it on the response's
`x-request-id` header (errors and SSE streams included) and into the scope's headers (so a
worker process that serves the request logs the same id), and counts the request by route and
status when it ends. The protocol handlers' `RequestLog` finds the request's `RequestContext`
(a context variable the layer sets) and reports tokens and timings to it; a request no handler
logged (discovery, /health, refusals at the edge) gets its line from the layer itself.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

if TYPE_CHECKING:
    from modelhost.server.observability.prometheus import Metrics

logger = logging.getLogger("modelhost.server")

REQUEST_ID_HEADER = "x-request-id"
_SANE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/+=@-]{0,127}")
QUIET_PATHS = frozenset({"/health", "/metrics"})  # probes and scrapes log at DEBUG


@dataclass(slots=True)
class RequestContext:
    """One request as the edge sees it; the handler's RequestLog reports into it."""

    request_id: str
    method: str
    path: str
    arrived_at: float  # time.monotonic() when the request reached the app
    metrics: Metrics | None
    status: int | None = None  # what the request log decided (499: the client left mid-stream)
    logged: bool = False
    # For the console's live view (observability/live_feed.py): the model that answers, the admitted
    # row while it generates (tokens so far), then the outcome, and when the request ended.
    model: str | None = None
    admitted: Any = None
    outcome: RequestOutcome | None = None
    ended_at: float | None = None
    started_wall: float = field(default_factory=time.time)


_CURRENT: ContextVar[RequestContext | None] = ContextVar("modelhost_request", default=None)


def current_request() -> RequestContext | None:
    """The context of the request being served in this task (None outside the edge layer)."""
    return _CURRENT.get()


def request_id_from(scope: Scope) -> str:
    """The client's `x-request-id` when it is sane (short, printable, no spaces), else a new id."""
    for key, value in scope.get("headers", []):
        if key.lower() == REQUEST_ID_HEADER.encode():
            candidate = value.decode("latin-1")
            if _SANE_ID.fullmatch(candidate):
                return candidate
            break
    return uuid.uuid4().hex


@dataclass(frozen=True, slots=True)
class RequestOutcome:
    """What a protocol handler's request log knows when its request ends."""

    route: str  # "POST /v1/chat/completions"
    status: int
    prompt_tokens: int | None
    completion_tokens: int | None
    ttft_s: float | None
    token_gap_s: float | None
    queue_s: float | None
    total_s: float


class RequestObserver(Protocol):
    """Told when each request reaches the edge and when it ends (the console's live feed is
    one); registered on the app (`app.state.request_observers`), not owned by the metrics."""

    def started(self, context: RequestContext) -> None: ...
    def ended(self, context: RequestContext, status: int) -> None: ...


class ObservedRequests:
    """Request ids, `x-request-id` on every response, request counts and the fallback log line;
    each request's start and end told to `observers`."""

    def __init__(
        self,
        app: ASGIApp,
        metrics: Metrics | None,
        observers: Sequence[RequestObserver] = (),
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.observers = observers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_from(scope)
        header = (REQUEST_ID_HEADER.encode(), request_id.encode())
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != header[0]]
        scope = {**scope, "headers": [*headers, header]}  # a worker that serves it logs this id
        context = RequestContext(
            request_id, scope["method"], scope["path"], time.monotonic(), self.metrics
        )
        status: int | None = None

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                out = [(k, v) for k, v in message.get("headers", []) if k.lower() != header[0]]
                message = {**message, "headers": [*out, header]}
            await send(message)

        token = _CURRENT.set(context)
        for observer in self.observers:
            observer.started(context)
        try:
            await self.app(scope, receive, send_with_id)
        except BaseException:
            status = status or 500
            raise
        finally:
            _CURRENT.reset(token)
            self._finish(scope, context, status)

    def _finish(self, scope: Scope, context: RequestContext, sent: int | None) -> None:
        status = context.status or sent or 499  # nothing sent: the client left first
        context.ended_at = time.monotonic()
        if self.metrics is not None:
            route = route_label(scope)
            self.metrics.requests.labels(context.method, route, str(status)).inc()
        for observer in self.observers:
            observer.ended(context, status)
        if not context.logged:
            total_ms = (time.monotonic() - context.arrived_at) * 1000
            level = logging.DEBUG if context.path in QUIET_PATHS else logging.INFO
            fields = {"method": context.method, "path": context.path, "status": status}
            logger.log(
                level,
                "- %s %s %d total_ms=%.1f request_id=%s",
                context.method,
                context.path,
                status,
                total_ms,
                context.request_id,
                extra={"request": {"request_id": context.request_id, **fields,
                                   "total_ms": round(total_ms, 1)}},
            )  # fmt: skip


def route_label(scope: Scope) -> str:
    """The matched route's path template (bounded label values); `unmatched` otherwise."""
    app = scope.get("app")
    for route in getattr(getattr(app, "router", None), "routes", ()):
        match, _ = route.matches(scope)
        if match is not Match.NONE:
            return str(getattr(route, "path", scope["path"]))
    return "unmatched"
