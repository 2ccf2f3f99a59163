"""Running the app: uvicorn with modelhost's shutdown rules.

On SIGINT or SIGTERM the server stops accepting connections and lets in-flight requests finish.
At 80 % of `shutdown_timeout_s` (and at least a second before it) it closes the app's engine
(`app.state.drain()`, called off the event loop): every request still running then ends the way
a closing engine ends it, a JSON 503 `server_closing` or one SSE error frame with code `closed`,
so clients see a clean end rather than a dropped socket.
uvicorn's own deadline stays the backstop. A server that shut down cleanly exits 0 (uvicorn
would re-raise the signal); a second SIGINT still forces the exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn
from starlette.applications import Starlette
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

DRAIN_AT = 0.8  # of the shutdown timeout: when in-flight requests are ended for good
DRAIN_MARGIN_S = 1.0  # at least this long before the deadline: a closing engine ends its step
logger = logging.getLogger("modelhost.server")
# Where a request's scope carries its connection's asyncio transport (see `ConnectionInScope`).
TRANSPORT_EXTENSION = "modelhost.transport"


class ConnectionInScope(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol that also puts the connection's transport in each request's
    scope, under `extensions[TRANSPORT_EXTENSION]["transport"]`: a worker's stream is written
    straight to the client's socket, which the front passes to it (`stream_handoff`)."""

    def on_message_begin(self) -> None:
        super().on_message_begin()
        extensions = self.scope.setdefault("extensions", {})
        extensions[TRANSPORT_EXTENSION] = {"transport": self.transport}


class Server(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        *,
        drain: Callable[[], None] | None = None,
        jobs: Any = None,
        live: Any = None,
    ):
        super().__init__(config)
        self.drain = drain
        self.jobs = jobs  # the app's job host (modelhost.jobs.manager.JobManager), if any
        self.live = live  # the app's LiveFeed (observability/live_feed.py), which consoles watch

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        stop_signals = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in stop_signals}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.jobs is not None:
            # Jobs first: a job driving this server's own API would otherwise keep requests
            # in flight, and the shutdown waiting for them.
            await self.jobs.stop_all()
        if self.live is not None:
            self.live.close()  # the consoles' live streams end now, not at the deadline
        timeout_s = self.config.timeout_graceful_shutdown
        pending = None
        if self.drain is not None and timeout_s is not None:
            loop = asyncio.get_running_loop()
            delay_s = max(0.0, timeout_s - max(DRAIN_MARGIN_S, (1 - DRAIN_AT) * timeout_s))
            pending = loop.call_later(delay_s, self._start_drain, loop)
        try:
            await super().shutdown(sockets)
        finally:
            if pending is not None:
                pending.cancel()

    def _start_drain(self, loop: asyncio.AbstractEventLoop) -> None:
        # Closing an engine waits for its current step: off the loop, which keeps serving.
        loop.run_in_executor(None, self._drain)

    def _drain(self) -> None:
        try:
            if self.drain is not None:
                self.drain()
        except Exception:
            logger.exception("draining in-flight requests failed")


def server_for(
    app: Starlette,
    *,
    host: str,
    port: int,
    shutdown_timeout_s: float = 10.0,
    log_level: str = "info",
) -> Server:
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        http=ConnectionInScope,
        log_level=log_level,
        access_log=False,  # one line per request comes from modelhost.server
        timeout_graceful_shutdown=shutdown_timeout_s,  # type: ignore[arg-type]
        lifespan="on",
    )
    # Jobs that drive this server's own API (bench-serve, eval-serve) call it here.
    app.state.base_url = f"http://{_connect_host(host)}:{port}"
    return Server(
        config,
        drain=getattr(app.state, "drain", None),
        jobs=getattr(app.state, "jobs", None),
        live=getattr(app.state, "live", None),
    )


def _connect_host(host: str) -> str:
    """Where a local client reaches a server bound to `host` (a wildcard means loopback)."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def serve(
    app: Starlette,
    *,
    host: str = "127.0.0.1",
    port: int = 8080,
    shutdown_timeout_s: float = 10.0,
    log_level: str = "info",
) -> bool:
    """Serve until SIGINT/SIGTERM; in-flight requests get `shutdown_timeout_s` to finish.
    False when the app failed to start (its lifespan raised)."""
    server = server_for(
        app, host=host, port=port, shutdown_timeout_s=shutdown_timeout_s, log_level=log_level
    )
    server.run()
    return bool(server.started)
