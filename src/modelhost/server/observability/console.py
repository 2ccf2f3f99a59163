"""The console: a web page on the server's own port, and the one event stream it adds.

| route                 | answer                                                              |
| --------------------- | ------------------------------------------------------------------- |
| `GET /`               | the page to a browser (`Accept: text/html`); `GET /v1`'s JSON else  |
| `GET /console/{file}` | the page's scripts, styles and icon (package files, no build step)  |
| `GET /api/live`       | SSE `event: snapshot`: requests in flight and just ended, residency; |
|                       | on each change, at most twice a second, each second while rows run  |

The page and its files hold no data, so they answer without the API key (the page asks for the
key and sends it on every call it makes); everything the page shows comes from the public API.
They carry a Content-Security-Policy that allows the server's own scripts only (no inline
script, no other origin), and the page inserts a model's text as text, never as HTML.
`--no-console` leaves `/` answering JSON and removes the rest.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.types import Scope

from modelhost.server.http import SSE_HEADERS
from modelhost.server.observability.live_feed import LiveFeed, merge_worker_rows
from modelhost.server.openai import discovery
from modelhost.server.openai.wire import openai_error

CONSOLE_DIR = Path(__file__).resolve().parents[2] / "console"  # modelhost/console
ASSET_PREFIX = "/console/"
LIVE_PATH = "/api/live"
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
}
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
    "media-src 'self' blob:; connect-src 'self'; font-src 'self'; manifest-src 'self'; "
    "base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
PAGE_HEADERS = {
    "content-security-policy": CONTENT_SECURITY_POLICY,
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "x-frame-options": "DENY",
    "permissions-policy": "microphone=(self), camera=(), geolocation=()",
    "cache-control": "no-cache",
}
SNAPSHOT_GAP_S = 0.5  # at most two snapshots a second, however busy the server is
IN_FLIGHT_TICK_S = 1.0  # while rows stream, their token counts move without a change event


def wants_page(scope: Scope) -> bool:
    """A browser's navigation: `GET /` whose Accept names HTML (a JSON client's does not)."""
    if scope.get("method") not in ("GET", "HEAD") or scope.get("path") != "/":
        return False
    for key, value in scope.get("headers", []):
        if key.lower() == b"accept":
            return b"text/html" in value.lower()
    return False


def is_console_file(scope: Scope) -> bool:
    """The page and its assets: they hold no data and answer without the API key."""
    path = scope.get("path", "")
    return wants_page(scope) or (scope.get("method") == "GET" and path.startswith(ASSET_PREFIX))


async def root(request: Request) -> Response:
    if request.app.state.settings.console and wants_page(request.scope):
        return _file(CONSOLE_DIR / "index.html")
    return await discovery.index(request)


async def asset(request: Request) -> Response:
    name = request.path_params["name"]
    path = (CONSOLE_DIR / name).resolve()
    if CONSOLE_DIR not in path.parents or not path.is_file() or path.suffix not in CONTENT_TYPES:
        return openai_error(404, {"message": f"no console file '{name}'", "type": "not_found"})
    return _file(path)


def _file(path: Path) -> Response:
    return FileResponse(path, media_type=CONTENT_TYPES[path.suffix], headers=PAGE_HEADERS)


async def live(request: Request) -> Response:
    """The live view's stream: a snapshot now, then one on each change (at most every
    `SNAPSHOT_GAP_S`), each second while a request is in flight, and a comment on quiet; it
    ends when the server starts shutting down (the page reconnects to the next one)."""
    feed: LiveFeed = request.app.state.live
    heartbeat_s: float = request.app.state.settings.heartbeat_s

    async def frames() -> AsyncIterator[str]:
        yield "retry: 1500\n\n"
        seen, quiet_since = -1, time.monotonic()
        while not feed.closed:
            version = feed.version
            if version != seen or feed.in_flight:
                seen, quiet_since = version, time.monotonic()
                snapshot = await live_snapshot(request.app)
                yield f"event: snapshot\ndata: {json.dumps(snapshot, separators=(',', ':'))}\n\n"
                await asyncio.sleep(SNAPSHOT_GAP_S)
            elif time.monotonic() - quiet_since >= heartbeat_s:
                quiet_since = time.monotonic()
                yield ": keep-alive\n\n"
            wait_s = IN_FLIGHT_TICK_S - SNAPSHOT_GAP_S if feed.in_flight else heartbeat_s
            await feed.changed(seen, wait_s)

    return StreamingResponse(frames(), media_type="text/event-stream", headers=SSE_HEADERS)


async def live_snapshot(app: Starlette) -> dict[str, Any]:
    """The requests (a worker's token figures merged in) and residency, as the page shows them."""
    feed: LiveFeed = app.state.live
    router = getattr(app.state, "router", None)
    worker_rows = await _worker_rows(router, feed.awaiting_figures()) if router else []
    feed.fill(worker_rows)
    rows = merge_worker_rows(feed.rows(), worker_rows)  # in flight: figures so far
    stage = getattr(app.state, "stage", None)
    if stage is not None:  # one model, no routing: every row is its model's
        rows = [{**row, "model": row["model"] or stage.model_id} for row in rows]
    snapshot: dict[str, Any] = {"time": time.time(), "requests": rows}
    if router is not None:
        snapshot["models"] = router.residency()
    return snapshot


async def _worker_rows(router: Any, models: set[str]) -> list[dict[str, Any]]:
    """What the worker processes serving `models` observed of their requests."""
    units = [router.host.peek(model_id) for model_id in models]
    workers = [unit for unit in units if unit is not None and hasattr(unit, "get_json")]

    async def ask(unit: Any) -> list[dict[str, Any]]:
        try:
            answer = await asyncio.wait_for(unit.get_json("/admin/requests"), 1.0)
        except Exception:  # a worker busy starting or stopping: its rows wait for the next
            return []
        requests = answer.get("requests") if isinstance(answer, dict) else None
        return requests if isinstance(requests, list) else []

    answers = await asyncio.gather(*(ask(unit) for unit in workers))
    return [row for answer in answers for row in answer if isinstance(row, dict)]


async def worker_requests(request: Request) -> Response:
    """`GET /admin/requests` on a worker's socket: its feed, for the front's live view."""
    return JSONResponse({"requests": request.app.state.live.rows()})


def install_console(app: Starlette) -> None:
    """`/` for browsers and JSON clients alike; with the console on, its files and live stream."""
    app.router.add_route("/", root, methods=["GET"])
    if app.state.settings.console:
        app.router.add_route(ASSET_PREFIX + "{name:path}", asset, methods=["GET"])
        app.router.add_route(LIVE_PATH, live, methods=["GET"])
