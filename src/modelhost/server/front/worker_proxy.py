"""The front's reverse proxy to a worker process: a request in, the worker's answer out.

The request goes with the time the front held it (`FRONT_WAITED_HEADER`: leasing, a load);
the worker's response streams through unchanged (hop-by-hop headers stripped, an
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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
from starlette.types import Receive, Scope, Send

from modelhost.inference.contracts import SERVER_SHUTTING_DOWN, EngineUnavailable
from modelhost.residency.workers.worker_unit import WorkerUnit
from modelhost.server.edge.cluster_secret import SECRET_HEADER
from modelhost.server.edge.request_context import current_request
from modelhost.server.front.stream_handoff import (
    HANDOFF_HEADER,
    READY,
    handoff_socket_path,
    header_value,
    is_stream_type,
    pass_socket,
)
from modelhost.server.http import (
    FRONT_WAITED_HEADER,
    ErrorShape,
    race_the_client,
    wait_for_disconnect,
)
from modelhost.server.http_server import TRANSPORT_EXTENSION


@dataclass(frozen=True, slots=True)
class Forwarded:
    """A request as the front forwards it, when its surface keeps state in the front: the body
    and the headers to send instead, and what the front does once the worker's answer ended."""

    body: bytes
    headers: list[tuple[bytes, bytes]]
    settle: Callable[[WorkerUnit], Awaitable[None]]


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
        SECRET_HEADER,  # the front's own, to a cluster's worker; never a client's
        FRONT_WAITED_HEADER,  # the front's own too
    }
)
# Set again by the front server on every response: relayed too, a client would see two of each.
FRONT_RESPONSE_HEADERS = frozenset({"date", "server"})
PID_HEADER = "x-modelhost-worker-pid"
NODE_HEADER = "x-modelhost-node"


def unavailable_body(model_id: str, why: str) -> dict[str, Any]:
    return {
        "message": f"the worker for '{model_id}' is unavailable: {why}",
        "type": "engine_unavailable",
        "code": "engine_unavailable",
    }


async def proxy(
    unit: WorkerUnit,
    scope: Scope,
    body: bytes,
    receive: Receive,
    send: Send,
    errors: ErrorShape,
    hand_off: bool = True,
) -> None:
    """Answer the request in `scope` (its body already read) from `unit`'s worker; refusals
    and a broken stream's last frame take the calling surface's `errors` shape. `hand_off`
    False keeps a stream in the front (the front writes every byte, its end included)."""
    path: str = scope["path"]

    async def refuse(why: str) -> None:
        response = errors.response(502, unavailable_body(unit.model_id, why))
        with contextlib.suppress(OSError):
            await response(scope, receive, send)

    if not await unit.worker.ensure_alive():
        await refuse("it exited and cannot be restarted now")
        return
    headers = [
        (k, v) for k, v in scope.get("headers", []) if k.decode("latin-1").lower() not in HOP_BY_HOP
    ]
    hands_off = hand_off and unit.hands_off and _client_transport(scope) is not None
    token = secrets.token_hex(16).encode() if hands_off else None
    if token is not None:
        headers.append((HANDOFF_HEADER, token))
    context = current_request()
    if context is not None:  # what leasing took before the worker sees the request
        waited_ms = (time.monotonic() - context.arrived_at) * 1000
        headers.append((FRONT_WAITED_HEADER.encode(), f"{waited_ms:.3f}".encode()))
    query = scope.get("query_string", b"").decode("latin-1")
    url = path + (f"?{query}" if query else "")
    for attempt in range(2):
        client = unit.client()
        request = client.build_request(scope["method"], url, headers=headers, content=body)
        try:
            upstream = await client.send(request, stream=True)
            break
        except httpx.TransportError as exc:
            # A worker that died since the last request: respawn it once and retry (the
            # request never reached a live engine, so nothing ran twice).
            died = await unit.worker.wait_dead(2.0)
            if attempt == 0 and died and await unit.worker.ensure_alive():
                continue
            await refuse(type(exc).__name__)
            return
    else:
        return
    try:
        await relay(unit, upstream, scope, receive, send, errors, token)
    finally:
        await upstream.aclose()


async def relay(
    unit: WorkerUnit,
    upstream: httpx.Response,
    scope: Scope,
    receive: Receive,
    send: Send,
    errors: ErrorShape,
    token: bytes | None = None,
) -> None:
    """Write the worker's answer `upstream` to the client (or hand its stream over)."""
    out_headers = [
        (k.lower(), v)
        for k, v in upstream.headers.raw
        if k.decode("latin-1").lower() not in HOP_BY_HOP | FRONT_RESPONSE_HEADERS
    ]
    out_headers.append((PID_HEADER.encode(), str(unit.pid).encode()))
    if unit.node is not None:
        out_headers.append((NODE_HEADER.encode(), unit.node.encode()))
    is_stream = is_stream_type(upstream.headers.get("content-type", "").encode("latin-1"))
    ready = token is not None and header_value(upstream.headers.raw, HANDOFF_HEADER) == READY
    if ready:
        out_headers.append((b"transfer-encoding", b"chunked"))  # the framing the worker writes

    async def write() -> None:
        await send(
            {"type": "http.response.start", "status": upstream.status_code, "headers": out_headers}
        )
        if ready:
            assert token is not None
            _hand_over(unit, scope, token)
        try:
            async for chunk in upstream.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except httpx.TransportError:
            if is_stream:
                frame = _cut_stream_frame(unit, errors)
                await send({"type": "http.response.body", "body": frame, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    writer = asyncio.create_task(write())
    listener = asyncio.create_task(wait_for_disconnect(receive))
    try:
        status = await race_the_client(writer, listener)
        context = current_request()
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


def _hand_over(unit: WorkerUnit, scope: Scope, token: bytes) -> None:
    """Pass the client's socket to the worker for the stream `token`, once the head is written
    to it (nothing may be left in the transport's buffer); otherwise decline."""
    transport = _client_transport(scope)
    fd = None
    if transport and not transport.is_closing() and not transport.get_write_buffer_size():
        fd = transport.get_extra_info("socket").fileno()
    path = handoff_socket_path(unit.worker.socket_path)
    if pass_socket(path, token, fd) and fd is not None:
        context = current_request()
        if context is not None and context.metrics is not None:
            context.metrics.handed_off_streams.inc()


def _cut_stream_frame(unit: WorkerUnit, errors: ErrorShape) -> bytes:
    if unit.ending:
        closing = EngineUnavailable(SERVER_SHUTTING_DOWN)
        return errors.stream_frame(closing.status, closing.body).encode()
    why = "it stopped in the middle of the stream"
    return errors.stream_frame(502, unavailable_body(unit.model_id, why)).encode()


def _client_transport(scope: Scope) -> asyncio.Transport | None:
    """The client connection's transport, when the front's server exposes it and the client
    can take a handed-off stream (HTTP/1.1, chunked); None otherwise."""
    if scope.get("http_version") != "1.1" or scope.get("method") != "POST":
        return None
    exposed = scope.get("extensions", {}).get(TRANSPORT_EXTENSION)
    return exposed.get("transport") if exposed else None
