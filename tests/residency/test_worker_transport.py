"""The parent's transport to a worker's socket (residency/worker_transport.py), against a bare
HTTP/1.1 server on a UNIX socket."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest

from modelhost.residency.workers.worker_transport import WorkerTransport

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> None:
    await reader.readuntil(b"\r\n\r\n")


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


async def answer_and_close(writer: asyncio.StreamWriter, data: bytes) -> None:
    """The worker's last bytes on this connection, then its end closes."""
    writer.write(data)
    await writer.drain()
    writer.close()
    await writer.wait_closed()


async def serve(path: Path, handler: Handler) -> asyncio.AbstractServer:
    return await asyncio.start_unix_server(handler, path=str(path))


def client(path: Path) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=WorkerTransport(str(path)), base_url="http://worker")


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


async def test_each_request_has_its_own_connection_which_asks_the_worker_to_close_it(
    tmp_path: Path,
):
    path = tmp_path / "w.sock"
    requests: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        requests.append(head + await reader.readexactly(length))
        await answer_and_close(writer, b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")

    server = await serve(path, handler)
    async with server, client(path) as http:
        first = await http.post("/v1/a?x=1", content=b'{"model":"m"}')
        second = await http.post("/v1/b", content=b"{}")
    assert (first.status_code, first.text, second.text) == (200, "ok", "ok")
    assert len(requests) == 2
    assert requests[0].startswith(b"POST /v1/a?x=1 HTTP/1.1\r\n")
    assert requests[0].endswith(b'\r\n\r\n{"model":"m"}')
    assert requests[0].lower().count(b"connection:") == 1
    assert b"connection: close\r\n" in requests[0].lower()


async def test_a_json_answer_arrives_whole_with_its_headers(tmp_path: Path):
    path = tmp_path / "w.sock"
    body = b'{"object":"list","data":[]}'

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await answer_and_close(
            writer,
            b"HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\n"
            b"x-request-id: r1\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body),
        )

    server = await serve(path, handler)
    async with server, client(path) as http:
        response = await http.get("/v1/models/x")
    assert response.status_code == 404
    assert response.headers["x-request-id"] == "r1"
    assert response.json() == {"object": "list", "data": []}


async def test_a_read_past_its_timeout_is_a_read_timeout(tmp_path: Path):
    path = tmp_path / "w.sock"
    answered = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await answered.wait()  # not in time
        writer.close()
        await writer.wait_closed()

    server = await serve(path, handler)
    async with server, client(path) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.get("/stats", timeout=0.05)
        answered.set()


async def test_an_interim_100_continue_before_the_answer_is_skipped(tmp_path: Path):
    path = tmp_path / "w.sock"

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)  # the interim answer arrives alone
        await answer_and_close(
            writer, b"HTTP/1.1 201 Created\r\nx-answer: yes\r\ncontent-length: 2\r\n\r\nok"
        )

    server = await serve(path, handler)
    async with server, client(path) as http:
        response = await http.post("/v1/x", content=b"{}")
    assert (response.status_code, response.text) == (201, "ok")
    assert response.headers["x-answer"] == "yes"


async def test_a_clients_expect_header_is_not_forwarded_to_the_worker(tmp_path: Path):
    path = tmp_path / "w.sock"
    heads: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        heads.append(await reader.readuntil(b"\r\n\r\n"))
        await answer_and_close(writer, b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")

    server = await serve(path, handler)
    async with server, client(path) as http:
        response = await http.post("/v1/x", content=b"{}", headers={"expect": "100-continue"})
    assert response.text == "ok"
    assert b"expect" not in heads[0].lower()
