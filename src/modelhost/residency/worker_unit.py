"""A unit whose model lives in a worker process; the parent proxies requests to its socket.

The proxy streams the worker's response through unchanged (hop-by-hop headers stripped, an
`x-modelhost-worker-pid` header added); an event stream's body the worker writes to the
client's socket itself, once the proxy has handed that over (`stream_handoff`). A worker that
cannot be reached answers 502 `engine_unavailable` in the calling protocol's error shape; a
stream that breaks after it opened ends with that protocol's own SSE error frame. The routing
middleware holds the lease until the proxied body has ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

import httpx
from starlette.types import Receive, Scope, Send

from modelhost.inference.contracts import SERVER_SHUTTING_DOWN, EngineUnavailable
from modelhost.residency.stream_handoff import (
    HANDOFF_HEADER,
    READY,
    handoff_socket_path,
    header_value,
    pass_socket,
)
from modelhost.residency.supervisor import MAX_RESTARTS, WorkerFailed, WorkerProcess
from modelhost.residency.worker import worker_config
from modelhost.residency.worker_transport import WorkerTransport
from modelhost.server.anthropic_wire import anthropic_error_json, event
from modelhost.server.http import stream_status, wait_for_disconnect
from modelhost.server.metrics import current_request
from modelhost.server.openai_wire import openai_error_json, sse
from modelhost.server.responses_wire import responses_error_json
from modelhost.server.runner import TRANSPORT_EXTENSION

if TYPE_CHECKING:
    from modelhost.residency.registry import ModelEntry
    from modelhost.server.app import ServeSettings

HOP_BY_HOP = frozenset(
    {
        HANDOFF_HEADER.decode(),
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
# Set again by the front server on every response: relayed too, a client would see two of each.
FRONT_RESPONSE_HEADERS = frozenset({"date", "server"})
PID_HEADER = "x-modelhost-worker-pid"
DRAIN_ANSWER_S = 2.0  # a forced drain answers at once; a worker that does not is killed


def unavailable_body(model_id: str, why: str) -> dict[str, Any]:
    return {
        "message": f"the worker for '{model_id}' is unavailable: {why}",
        "type": "engine_unavailable",
        "code": "engine_unavailable",
    }


def stream_error_frame(path: str, status: int, body: Mapping[str, Any]) -> str:
    """The calling protocol's own SSE error frame."""
    if path.startswith("/v1/messages"):
        return event("error", {"error": anthropic_error_json(status, body)["error"]})
    if path.startswith("/v1/responses"):
        error = responses_error_json(status, body)["error"]
        return event("error", {**error, "type": "error", "param": error.get("param")})
    return sse(openai_error_json(status, body))


class WorkerUnit:
    resumed = False

    def __init__(self, model_id: str, weights_bytes: int, worker: WorkerProcess) -> None:
        self._model_id = model_id
        self.weights_bytes = weights_bytes
        self.worker = worker
        self.load_ms = 0.0
        self._measured: int | None = None
        self._closed = False
        # Set once the server's shutdown ends this unit's requests (interrupt, close): a stream
        # then cut by the worker's connection closing ends as the shutdown's `closed`, not as
        # a worker failure (whichever of the worker's frame and the break comes first).
        self._ending = False
        self._client: httpx.AsyncClient | None = None
        self._client_socket: str | None = None
        self.card_row: dict[str, Any] | None = None

    @property
    def model_id(self) -> str:
        return self._model_id

    @property
    def pid(self) -> int | None:
        return self.worker.pid

    def measured_bytes(self) -> int | None:
        """The worker's RSS at the last reading, never below the weights."""
        if self._closed:
            return None
        rss = self.worker.rss_bytes()
        if rss is not None:
            self._measured = max(rss, self.weights_bytes)
        return self._measured

    async def refresh(self) -> None:
        self.measured_bytes()

    def broken(self) -> bool:
        return self.worker.exhausted()

    def pause(self) -> None:
        return None

    def resume(self) -> None:
        return None

    def interrupt(self) -> None:
        """End every request now (a forced shutdown; any thread): the worker's own drain ends
        each with its protocol's `closed` error; a worker that does not answer is killed."""
        self._ending = True
        if not self.worker.alive():
            return
        try:
            transport = httpx.HTTPTransport(uds=self.worker.socket_path)
            with httpx.Client(transport=transport, base_url="http://worker") as client:
                client.post(
                    "/admin/drain", json={"timeout_ms": 0, "force": True}, timeout=DRAIN_ANSWER_S
                ).raise_for_status()
        except httpx.HTTPError:
            self.worker.kill_now()

    async def close(self) -> bool:
        if not self._closed:
            self._closed = self._ending = True
            if self._client is not None:
                with contextlib.suppress(Exception):
                    await self._client.aclose()
            await self.worker.stop()
        return True

    def _http(self) -> httpx.AsyncClient:
        socket_path = self.worker.socket_path
        if self._client is None or self._client_socket != socket_path:
            old, self._client = self._client, None
            if old is not None:
                asyncio.get_running_loop().create_task(old.aclose())
            transport = WorkerTransport(socket_path)
            timeout = httpx.Timeout(connect=10.0, read=None, write=60.0, pool=60.0)
            self._client = httpx.AsyncClient(
                transport=transport, base_url="http://worker", timeout=timeout
            )
            self._client_socket = socket_path
        return self._client

    async def get_json(self, path: str) -> dict[str, Any] | None:
        """A GET on the worker (its /stats), or None when it cannot be reached or answers
        anything but 200."""
        if not await self.worker.ensure_alive():
            return None
        try:
            response = await self._http().get(path, timeout=10.0)
            value = response.json() if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None
        return value if isinstance(value, dict) else None

    async def proxy(
        self,
        scope: Scope,
        body: bytes,
        receive: Receive,
        send: Send,
        format_error: Callable[[int, Mapping[str, Any]], Any],
    ) -> None:
        path: str = scope["path"]

        async def refuse(why: str) -> None:
            response = format_error(502, unavailable_body(self.model_id, why))
            with contextlib.suppress(OSError):
                await response(scope, receive, send)

        if not await self.worker.ensure_alive():
            await refuse("it exited and cannot be restarted now")
            return
        headers = [
            (k, v)
            for k, v in scope.get("headers", [])
            if k.decode("latin-1").lower() not in HOP_BY_HOP
        ]
        token = secrets.token_hex(16).encode() if _client_transport(scope) else None
        if token is not None:
            headers.append((HANDOFF_HEADER, token))
        query = scope.get("query_string", b"").decode("latin-1")
        url = path + (f"?{query}" if query else "")
        for attempt in range(2):
            client = self._http()
            request = client.build_request(scope["method"], url, headers=headers, content=body)
            try:
                upstream = await client.send(request, stream=True)
                break
            except httpx.TransportError as exc:
                # A worker that died since the last request: respawn it once and retry (the
                # request never reached a live engine, so nothing ran twice).
                died = await self.worker.wait_dead(2.0)
                if attempt == 0 and died and await self.worker.ensure_alive():
                    continue
                await refuse(type(exc).__name__)
                return
        else:
            return
        try:
            await self._relay(upstream, scope, receive, send, token)
        finally:
            await upstream.aclose()

    async def _relay(
        self,
        upstream: httpx.Response,
        scope: Scope,
        receive: Receive,
        send: Send,
        token: bytes | None = None,
    ) -> None:
        out_headers = [
            (k.lower(), v)
            for k, v in upstream.headers.raw
            if k.decode("latin-1").lower() not in HOP_BY_HOP | FRONT_RESPONSE_HEADERS
        ]
        out_headers.append((PID_HEADER.encode(), str(self.worker.pid).encode()))
        is_stream = upstream.headers.get("content-type", "").startswith("text/event-stream")
        ready = token is not None and header_value(upstream.headers.raw, HANDOFF_HEADER) == READY
        if ready:
            out_headers.append((b"transfer-encoding", b"chunked"))  # the framing the worker writes

        async def write() -> None:
            await send(
                {
                    "type": "http.response.start",
                    "status": upstream.status_code,
                    "headers": out_headers,
                }
            )
            if ready:
                assert token is not None
                self._hand_over(scope, token)
            try:
                async for chunk in upstream.aiter_raw():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except httpx.TransportError:
                if is_stream:
                    frame = self._cut_stream_frame(scope["path"])
                    await send({"type": "http.response.body", "body": frame, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        writer = asyncio.create_task(write())
        listener = asyncio.create_task(wait_for_disconnect(receive))
        try:
            await asyncio.wait({writer, listener}, return_when=asyncio.FIRST_COMPLETED)
            context, status = current_request(), stream_status(writer)
            if context is not None and status is not None:
                context.status = status  # the front logs and counts what the worker does
        finally:
            for task in (writer, listener):
                task.cancel()
            await asyncio.wait({writer, listener})
        if writer.done() and not writer.cancelled() and writer.exception() is not None:
            error = writer.exception()
            if not isinstance(error, OSError):
                raise error  # type: ignore[misc]

    def _hand_over(self, scope: Scope, token: bytes) -> None:
        """Pass the client's socket to the worker for the stream `token`, once the head is
        written to it (nothing may be left in the transport's buffer); otherwise decline."""
        transport = _client_transport(scope)
        fd = None
        if transport and not transport.is_closing() and not transport.get_write_buffer_size():
            fd = transport.get_extra_info("socket").fileno()
        path = handoff_socket_path(self.worker.socket_path)
        if pass_socket(path, token, fd) and fd is not None:
            context = current_request()
            if context is not None and context.metrics is not None:
                context.metrics.handed_off_streams.inc()

    def _cut_stream_frame(self, path: str) -> bytes:
        if self._ending:
            closing = EngineUnavailable(SERVER_SHUTTING_DOWN)
            return stream_error_frame(path, closing.status, closing.body).encode()
        why = "it stopped in the middle of the stream"
        return stream_error_frame(path, 502, unavailable_body(self.model_id, why)).encode()


def _client_transport(scope: Scope) -> asyncio.Transport | None:
    """The client connection's transport, when the front's server exposes it and the client
    can take a handed-off stream (HTTP/1.1, chunked); None otherwise."""
    if scope.get("http_version") != "1.1" or scope.get("method") != "POST":
        return None
    exposed = scope.get("extensions", {}).get(TRANSPORT_EXTENSION)
    return exposed.get("transport") if exposed else None


def worker_loader(
    settings: ServeSettings,
    *,
    batch: int = 8,
    max_queue: int = 64,
    log_level: str = "warning",
    start_timeout_s: float = 120.0,
    max_restarts: int = MAX_RESTARTS,
) -> Callable[[ModelEntry], Awaitable[WorkerUnit]]:
    """The host's `load`: spawn a worker for the entry and wait until it answers."""
    config = worker_config(settings, batch=batch, max_queue=max_queue)

    async def load(entry: ModelEntry) -> WorkerUnit:
        started = time.perf_counter()
        operations = ",".join(entry.operations)
        args = ["--model", str(entry.path), "--id", entry.id, "--operations", operations]
        args += ["--config", config]
        worker = WorkerProcess(
            [*args, "--log-level", log_level],
            start_timeout_s=start_timeout_s,
            max_restarts=max_restarts,
        )
        try:
            await worker.start()
        except WorkerFailed as exc:
            raise RuntimeError(str(exc)) from None
        except BaseException:
            await worker.stop()
            raise
        unit = WorkerUnit(entry.id, entry.weights_bytes, worker)
        unit.load_ms = (time.perf_counter() - started) * 1000
        listed = await unit.get_json("/v1/models")
        rows = listed.get("data") if listed is not None else None
        if isinstance(rows, list) and rows and isinstance(rows[0], dict):
            unit.card_row = rows[0]  # what /v1/models lists for it (fixed for its lifetime)
        return unit

    return load
