"""The worker's side of a handed-off stream: what reaches the client's socket, what still goes to
the front, and that the worker keeps no copy of the client's socket afterwards."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from modelhost.cli.worker import bind_private_socket
from modelhost.server.front.stream_handoff import (
    HANDOFF_HEADER,
    READY,
    SocketReceiver,
    StreamHandoff,
    pass_socket,
)

TOKEN = b"0123456789abcdef0123456789abcdef"
FRAMES = [b"data: one\n\n", b"data: two\n\n"]
SSE_HEAD = {
    "type": "http.response.start",
    "status": 200,
    "headers": [(b"content-type", b"text/event-stream; charset=utf-8")],
}


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[tuple[SocketReceiver, str]]:
    path = str(tmp_path / "handoff.sock")
    receiver = SocketReceiver(bind_private_socket(path))
    yield receiver, path
    receiver.close()


@pytest.fixture
def client() -> Iterator[tuple[socket.socket, socket.socket]]:
    """The client's connection: the end the server writes to, and the client's own end."""
    served, own = socket.socketpair()
    own.settimeout(5)
    yield served, own
    served.close()
    own.close()


def stream_app(frames: list[bytes], head: dict[str, Any] = SSE_HEAD) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send(head)
        for frame in frames:
            await send({"type": "http.response.body", "body": frame, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


def scope_asking_handoff() -> dict[str, Any]:
    return {"type": "http", "method": "POST", "path": "/v1/chat/completions",
            "headers": [(HANDOFF_HEADER, TOKEN)]}  # fmt: skip


def front(path: str, fd: int | None) -> tuple[list[dict[str, Any]], Any]:
    """The front's end of the worker's answer: it records the messages and, when the head says
    the worker is ready, passes `fd` (None declines)."""
    relayed: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        relayed.append(message)
        if (HANDOFF_HEADER, READY) in message.get("headers", []):
            assert pass_socket(path, TOKEN, fd)

    return relayed, send


def read_all(own: socket.socket) -> bytes:
    data = b""
    while chunk := own.recv(65536):
        data += chunk
    return data


async def test_a_handed_off_stream_reaches_the_client_in_chunks_and_the_front_gets_head_and_end(
    receiver, client
):
    handoff, path = receiver
    served, own = client
    relayed, send = front(path, served.fileno())
    await StreamHandoff(stream_app(FRAMES), handoff)(scope_asking_handoff(), None, send)
    assert [m["type"] for m in relayed] == ["http.response.start", "http.response.body"]
    assert relayed[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    served.close()  # the worker closed its copy: this was the last one, so the client sees EOF
    assert read_all(own) == b"b\r\ndata: one\n\n\r\nb\r\ndata: two\n\n\r\n"


async def test_a_declined_handoff_leaves_the_stream_relayed_through_the_front(receiver, client):
    handoff, path = receiver
    served, own = client
    relayed, send = front(path, None)
    await StreamHandoff(stream_app(FRAMES), handoff)(scope_asking_handoff(), None, send)
    assert [m.get("body") for m in relayed[1:]] == [*FRAMES, b""]
    served.close()
    assert read_all(own) == b""


async def test_a_json_answer_is_relayed_unchanged_even_when_the_front_asked(receiver, client):
    handoff, path = receiver
    head = {"type": "http.response.start", "status": 200,
            "headers": [(b"content-type", b"application/json")]}  # fmt: skip
    relayed, send = front(path, client[0].fileno())
    await StreamHandoff(stream_app([b"{}"], head), handoff)(scope_asking_handoff(), None, send)
    assert relayed[0] == head
    assert [m.get("body") for m in relayed[1:]] == [b"{}", b""]


async def test_a_client_gone_mid_stream_fails_the_apps_write_and_ends_the_answer_once(
    receiver, client
):
    handoff, path = receiver
    served, own = client
    relayed, send = front(path, served.fileno())
    own.close()
    failures: list[type[BaseException]] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send(SSE_HEAD)
        try:
            await send({"type": "http.response.body", "body": b"data: x\n\n", "more_body": True})
        except OSError as exc:
            failures.append(type(exc))
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    await StreamHandoff(app, handoff)(scope_asking_handoff(), None, send)
    assert failures == [BrokenPipeError]
    assert [m.get("more_body") for m in relayed[1:]] == [False]  # one end, and no error after it


async def test_a_socket_passed_for_a_stream_no_longer_waiting_is_closed(receiver, client):
    handoff, path = receiver
    served, own = client
    handoff.expect(b"f" * 32)  # the receiver listens from its first stream on
    assert pass_socket(path, TOKEN, served.fileno())  # nobody waits for TOKEN
    await asyncio.sleep(0.2)
    served.close()
    assert read_all(own) == b""  # no copy of it is left open in the worker


def test_the_front_declines_when_the_worker_has_no_handoff_socket(tmp_path: Path):
    served, own = socket.socketpair()
    with served, own:
        assert not pass_socket(str(tmp_path / "missing.sock"), TOKEN, served.fileno())


async def test_a_slow_clients_stream_arrives_whole_and_in_order_before_the_front_gets_the_end(
    receiver, client
):
    handoff, path = receiver
    served, own = client
    served.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    own.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    frames = [b"data: %04d %s\n\n" % (n, b"x" * 2000) for n in range(100)]  # 200 KB, 4 KB buffers
    expected = b"".join(b"%x\r\n%b\r\n" % (len(f), f) for f in frames)
    relayed, send = front(path, served.fileno())
    received = bytearray()

    def read_slowly() -> None:  # a client that reads 1 KB every millisecond
        while len(received) < len(expected):
            received.extend(own.recv(1024))
            time.sleep(0.001)

    reader = threading.Thread(target=read_slowly)
    reader.start()
    try:
        await StreamHandoff(stream_app(frames), handoff)(scope_asking_handoff(), None, send)
    finally:
        await asyncio.to_thread(reader.join, 30)
    assert relayed[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert bytes(received) == expected
