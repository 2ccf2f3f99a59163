"""The front's side of a worker: the relay of its stream (a worker that dies after the stream
opened leaves the client one error frame in the calling protocol's own SSE shape, then a clean
end), when it hands a stream's client socket to the worker, and what the parent tells a worker
when it starts."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from modelhost.cli.worker import bind_private_socket
from modelhost.residency.workers.supervisor import WorkerProcess
from modelhost.residency.workers.worker_unit import WorkerUnit
from modelhost.serve_config import WorkerConfig
from modelhost.server.edge.request_context import ObservedRequests
from modelhost.server.front.stream_handoff import HANDOFF_HEADER, handoff_socket_path
from modelhost.server.front.worker_proxy import relay
from modelhost.server.http_server import TRANSPORT_EXTENSION
from modelhost.server.observability.prometheus import Metrics
from modelhost.server.settings import ServeSettings
from modelhost.server.surfaces import SURFACES


class DyingStream(httpx.AsyncByteStream):
    """One frame, then the connection breaks (the worker was killed)."""

    def __init__(self, first: bytes) -> None:
        self.first = first

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield self.first
        raise httpx.RemoteProtocolError("peer closed connection without sending complete body")


async def relayed(
    path: str,
    first: bytes,
    content_type: str = "text/event-stream",
    *,
    unit: WorkerUnit | None = None,
) -> tuple[list[dict[str, Any]], bytes]:
    """What the client is sent when the worker's answer breaks after `first`."""
    unit = unit or WorkerUnit("tiny-a", 1, WorkerProcess([]))
    upstream = httpx.Response(
        200, headers={"content-type": content_type}, stream=DyingStream(first)
    )
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()  # the client stays
        return {"type": "http.disconnect"}

    scope = {"type": "http", "method": "POST", "path": path}
    await relay(unit, upstream, scope, receive, send, SURFACES.errors_for(scope["path"]))
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent, body


def frames(body: bytes) -> list[str]:
    return [line for line in body.decode().splitlines() if line]


async def test_a_chat_stream_ends_with_one_openai_error_frame():
    sent, body = await relayed("/v1/chat/completions", b'data: {"choices":[]}\n\n')
    lines = frames(body)
    assert lines[0] == 'data: {"choices":[]}'
    error = json.loads(lines[-1].removeprefix("data: "))["error"]
    assert error["code"] == "engine_unavailable" and len(lines) == 2
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}


async def test_an_anthropic_stream_ends_with_one_anthropic_error_event():
    _, body = await relayed("/v1/messages", b"event: ping\ndata: {}\n\n")
    lines = frames(body)
    assert lines[-2] == "event: error" and lines.count("event: error") == 1
    frame = json.loads(lines[-1].removeprefix("data: "))
    assert frame["type"] == "error" and frame["error"]["type"] == "api_error"
    assert "unavailable" in frame["error"]["message"]


async def test_a_responses_stream_ends_with_one_responses_error_event():
    _, body = await relayed("/v1/responses", b"event: response.created\ndata: {}\n\n")
    lines = frames(body)
    assert lines[-2] == "event: error" and lines.count("event: error") == 1
    frame = json.loads(lines[-1].removeprefix("data: "))
    assert frame["type"] == "error" and frame["code"] == "engine_unavailable"


async def test_a_stream_cut_by_the_servers_own_shutdown_ends_as_closed_not_as_a_failure():
    unit = WorkerUnit("tiny-a", 1, WorkerProcess([]))
    unit.interrupt()  # the shutdown's deadline came; the worker's connection then breaks
    _, body = await relayed("/v1/chat/completions", b'data: {"choices":[]}\n\n', unit=unit)
    lines = frames(body)
    error = json.loads(lines[-1].removeprefix("data: "))["error"]
    assert error["code"] == "closed" and error["type"] == "server_closing" and len(lines) == 2


class EndlessStream(httpx.AsyncByteStream):
    async def __aiter__(self) -> AsyncIterator[bytes]:
        while True:
            yield b'data: {"choices":[]}\n\n'
            await asyncio.sleep(0.01)


class EndingStream(httpx.AsyncByteStream):
    """A stream whose body ends a moment after its last event."""

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield b"event: response.completed\ndata: {}\n\n"
        await asyncio.sleep(0.02)


async def relay_to_a_leaving_client(
    stream: httpx.AsyncByteStream, path: str, leave_after: int, metrics: Metrics
) -> None:
    """Relay the worker's `stream` on `path` to a client that disconnects once `leave_after`
    messages (the response's start, then its body's chunks) have reached it, through the
    front's request log and metrics."""
    unit = WorkerUnit("tiny-a", 1, WorkerProcess([]))
    upstream = httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=stream)
    sent: list[dict[str, Any]] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await relay(unit, upstream, scope, receive, send, SURFACES.errors_for(scope["path"]))

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        while len(sent) < leave_after:
            await asyncio.sleep(0.001)
        return {"type": "http.disconnect"}

    scope = {"type": "http", "method": "POST", "path": path, "headers": []}
    await ObservedRequests(app, metrics)(scope, receive, send)


async def test_a_client_that_leaves_a_relayed_stream_is_logged_and_counted_as_499(
    caplog: pytest.LogCaptureFixture,
):
    caplog.set_level(logging.INFO, logger="modelhost.server")
    metrics = Metrics(SimpleNamespace())
    # the response started and two frames came through
    await relay_to_a_leaving_client(EndlessStream(), "/v1/chat/completions", 3, metrics)
    assert "POST /v1/chat/completions 499 " in caplog.text
    assert 'status="499"' in metrics.render().decode()


async def test_a_client_that_closes_right_after_the_last_event_is_not_logged_as_499(
    caplog: pytest.LogCaptureFixture,
):
    caplog.set_level(logging.INFO, logger="modelhost.server")
    # Codex closes once it has read `response.completed`
    await relay_to_a_leaving_client(EndingStream(), "/v1/responses", 2, Metrics(SimpleNamespace()))
    assert "POST /v1/responses 200 " in caplog.text
    assert " 499 " not in caplog.text


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
async def test_a_json_answer_cut_short_gets_no_sse_frame(path):
    _, body = await relayed(path, b'{"id":', content_type="application/json")
    assert body == b'{"id":'  # the client sees a truncated body, never a stream frame in JSON


def test_a_worker_is_never_given_the_api_key_on_its_command_line():
    config = WorkerConfig(ServeSettings(api_key="s3cret-key"), batch=2, max_queue=4).to_json()
    assert "s3cret-key" not in config
    assert json.loads(config)["batch"] == 2


class FakeTransport:
    """The client connection's transport, as the front's server exposes it."""

    def __init__(self, sock: socket.socket, buffered: int) -> None:
        self.sock = sock
        self.buffered = buffered

    def get_extra_info(self, name: str) -> Any:
        return self.sock if name == "socket" else None

    def is_closing(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return self.buffered


@pytest.mark.parametrize(("buffered", "passed"), [(0, 1), (12, 0)])
async def test_a_ready_worker_gets_the_clients_socket_only_once_the_head_has_left_the_buffer(
    tmp_path, buffered, passed
):
    unit = WorkerUnit("tiny-a", 1, WorkerProcess([]))
    unit.worker.directory = tmp_path
    listener = bind_private_socket(handoff_socket_path(unit.worker.socket_path))
    served, own = socket.socketpair()
    token = b"f" * 32
    upstream = httpx.Response(
        200,
        headers={"content-type": "text/event-stream", HANDOFF_HEADER.decode(): "ready"},
        stream=httpx.ByteStream(b""),
    )
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    exposed = {TRANSPORT_EXTENSION: {"transport": FakeTransport(served, buffered)}}
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
             "http_version": "1.1", "extensions": exposed}  # fmt: skip
    with listener, served, own:
        await relay(unit, upstream, scope, receive, send, SURFACES.errors_for(scope["path"]), token)
        channel, _ = listener.accept()
        with channel:
            told, fds, _, _ = socket.recv_fds(channel, 64, 1)
        for fd in fds:
            os.close(fd)
    assert told == token and len(fds) == passed  # no socket: the worker relays the stream
    head = dict(sent[0]["headers"])
    assert head[b"transfer-encoding"] == b"chunked" and HANDOFF_HEADER not in head
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}


async def test_an_ollama_stream_ends_with_one_ollama_error_line():
    first = b'{"model":"m","response":"Hi","done":false}\n'
    _, body = await relayed("/api/generate", first, content_type="application/x-ndjson")
    lines = frames(body)
    assert lines[0] == first.decode().strip() and len(lines) == 2
    assert set(json.loads(lines[-1])) == {"error"}
    assert "unavailable" in json.loads(lines[-1])["error"]
