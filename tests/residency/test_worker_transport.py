"""The parent's transport to a worker's socket (residency/worker_transport.py), against a bare
HTTP/1.1 server on a UNIX socket."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpcore
import httpx
import pytest

from modelhost.residency.worker_transport import AsyncioUnixBackend, worker_transport

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> None:
    await reader.readuntil(b"\r\n\r\n")


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


async def serve(path: Path, handler: Handler) -> asyncio.AbstractServer:
    return await asyncio.start_unix_server(handler, path=str(path))


def client(path: Path) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=worker_transport(str(path)), base_url="http://worker")


async def test_a_streamed_body_arrives_chunk_by_chunk(tmp_path: Path):
    path = tmp_path / "w.sock"
    frames = [b"data: %d\n\n" % i for i in range(5)]

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(HEAD)
        for frame in frames:
            writer.write(chunk(frame))
            await writer.drain()
            await asyncio.sleep(0.01)  # one chunk per read, as tokens arrive
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()
        await writer.wait_closed()

    server = await serve(path, handler)
    async with server, client(path) as http, http.stream("POST", "/v1/x") as response:
        got = [piece async for piece in response.aiter_raw()]
    assert response.status_code == 200
    assert b"".join(got) == b"".join(frames)
    assert len(got) == len(frames)


async def test_a_worker_that_closes_mid_body_is_a_transport_error(tmp_path: Path):
    path = tmp_path / "w.sock"

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(HEAD + chunk(b"data: 1\n\n"))
        await writer.drain()
        writer.close()  # no last chunk: the worker died mid-stream
        await writer.wait_closed()

    server = await serve(path, handler)
    async with server, client(path) as http, http.stream("POST", "/v1/x") as response:
        with pytest.raises(httpx.TransportError):
            async for _ in response.aiter_raw():
                pass


async def test_a_missing_socket_is_a_connect_error(tmp_path: Path):
    async with client(tmp_path / "gone.sock") as http:
        with pytest.raises(httpx.ConnectError):
            await http.get("/stats")


async def test_a_connection_the_worker_closed_while_idle_is_not_reused(tmp_path: Path):
    path = tmp_path / "w.sock"
    connections = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()  # keep-alive offered, then the worker's end closes (a restart)
        await writer.wait_closed()

    server = await serve(path, handler)
    async with server, client(path) as http:
        assert (await http.get("/a")).text == "ok"
        await asyncio.sleep(0.05)  # the close reaches the idle connection
        assert (await http.get("/b")).text == "ok"
    assert len(connections) == 2


async def test_a_read_past_its_timeout_is_a_read_timeout(tmp_path: Path):
    path = tmp_path / "w.sock"
    answered = asyncio.Event()
    closed = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await answered.wait()  # not in time
        writer.close()
        await writer.wait_closed()
        closed.set()

    server = await serve(path, handler)
    stream = await AsyncioUnixBackend().connect_unix_socket(str(path))
    async with server:
        await stream.write(b"GET / HTTP/1.1\r\nhost: worker\r\n\r\n")
        with pytest.raises(httpcore.ReadTimeout):
            await stream.read(1024, timeout=0.05)
        answered.set()
        await closed.wait()
        await stream.aclose()
