"""httpx's transport to a worker's UNIX socket: HTTP/1.1 on asyncio's streams, parsed by httptools.

The proxy keeps httpx's client (requests, timeouts, errors); only the wire underneath is ours.
httpcore parses every chunk of a relayed stream with h11, in Python: 17 us warm a chunk, more
between decode steps, and a streamed token is one chunk. httptools (uvicorn's own C parser,
already a dependency) takes 0.35 us. The peer is always our own uvicorn on a private socket,
so a connection carries one request (`connection: close`): no pool, and nothing to reuse after
a worker restarts. Errors are httpx's TransportErrors, as its own transports raise them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator

import httptools
import httpx

READ_BYTES = 65536
# Ours says `connection: close`; the body goes out with the head, so nothing waits for a
# `100 Continue` (a client's `expect` would have the worker send one first).
_NOT_FORWARDED = frozenset({b"connection", b"expect"})


class _Message:
    """httptools' callbacks for one response: its headers, then its body's pieces. An interim
    (1xx) response before it is skipped, as httpx's own transports do."""

    def __init__(self, head_only: bool) -> None:
        self.head_only = head_only  # a HEAD request's response has headers only
        self.parser = httptools.HttpResponseParser(self)
        self.headers: list[tuple[bytes, bytes]] = []
        self.headers_done = False
        self.body: deque[bytes] = deque()
        self.complete = False
        self._interim = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._interim = self.parser.get_status_code() < 200
        if self._interim:
            self.headers.clear()
            return
        self.headers_done = True
        self.complete = self.head_only

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        self.complete = True


class _Connection:
    """One request's connection: reads feed the parser, errors become httpx's."""

    def __init__(
        self,
        request: httpx.Request,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        read_timeout: float | None,
    ) -> None:
        self.request = request
        self.reader = reader
        self.writer = writer
        self.message = _Message(head_only=request.method == "HEAD")
        self.read_timeout = read_timeout

    async def send_request(self, timeout: float | None) -> None:
        request = self.request
        target = request.url.raw_path.decode("ascii")
        lines = [f"{request.method} {target} HTTP/1.1".encode()]
        lines += [
            name + b": " + value
            for name, value in request.headers.raw
            if name.lower() not in _NOT_FORWARDED
        ]
        head = b"\r\n".join([*lines, b"connection: close", b"", b""])
        try:
            async with asyncio.timeout(timeout):
                self.writer.write(head)
                async for part in request.stream:  # type: ignore[union-attr]
                    self.writer.write(part)
                await self.writer.drain()
        except TimeoutError as exc:
            raise httpx.WriteTimeout(str(exc), request=request) from exc
        except OSError:
            # The worker may have answered and closed before taking the whole body (as
            # httpcore does, read its answer; a worker that sent none fails that read).
            pass

    async def read_more(self) -> None:
        """Feed the parser what the worker sent next; the worker closing first is an error."""
        try:
            if self.read_timeout is None:  # a relayed stream's reads: one a token
                data = await self.reader.read(READ_BYTES)
            else:
                async with asyncio.timeout(self.read_timeout):
                    data = await self.reader.read(READ_BYTES)
        except TimeoutError as exc:
            raise httpx.ReadTimeout(str(exc), request=self.request) from exc
        except OSError as exc:
            raise httpx.ReadError(str(exc), request=self.request) from exc
        if not data:
            raise httpx.RemoteProtocolError(
                "the worker closed the connection before the response ended", request=self.request
            )
        try:
            self.message.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            raise httpx.RemoteProtocolError(str(exc), request=self.request) from exc

    def close(self) -> None:
        self.writer.close()


class _Body(httpx.AsyncByteStream):
    """The response's body, piece by piece as the worker sends it."""

    def __init__(self, connection: _Connection) -> None:
        self._connection = connection

    async def __aiter__(self) -> AsyncIterator[bytes]:
        message = self._connection.message
        while True:
            while message.body:
                yield message.body.popleft()
            if message.complete:
                return
            await self._connection.read_more()

    async def aclose(self) -> None:
        self._connection.close()


class WorkerTransport(httpx.AsyncBaseTransport):
    """httpx's transport to the worker listening on `socket_path`, or on TCP at `address`
    (a cluster node's worker)."""

    def __init__(self, socket_path: str = "", *, address: tuple[str, int] | None = None) -> None:
        self.socket_path = socket_path
        self.address = address

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeouts = request.extensions.get("timeout", {})
        try:
            async with asyncio.timeout(timeouts.get("connect")):
                if self.address is not None:
                    reader, writer = await asyncio.open_connection(*self.address)
                else:
                    reader, writer = await asyncio.open_unix_connection(self.socket_path)
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(str(exc), request=request) from exc
        except OSError as exc:
            raise httpx.ConnectError(str(exc), request=request) from exc
        connection = _Connection(request, reader, writer, timeouts.get("read"))
        try:
            await connection.send_request(timeouts.get("write"))
            while not connection.message.headers_done:
                await connection.read_more()
        except BaseException:
            connection.close()
            raise
        return httpx.Response(
            connection.message.parser.get_status_code(),
            headers=connection.message.headers,
            stream=_Body(connection),
            extensions={"http_version": b"HTTP/1.1"},
        )


class WorkerClient:
    """An HTTP client on a worker's endpoint (a socket path, or a TCP address), made anew when
    the endpoint changes: a respawned worker listens somewhere else."""

    def __init__(self) -> None:
        self._client: httpx.AsyncClient | None = None
        self._endpoint: str | tuple[str, int] | None = None

    def on(
        self, endpoint: str | tuple[str, int], headers: dict[str, str] | None = None
    ) -> httpx.AsyncClient:
        """The client for `endpoint` (`headers` go on every request of a new one)."""
        if self._client is None or self._endpoint != endpoint:
            old, self._client = self._client, None
            if old is not None:
                asyncio.get_running_loop().create_task(old.aclose())
            if isinstance(endpoint, tuple):
                transport = WorkerTransport(address=endpoint)
            else:
                transport = WorkerTransport(endpoint)
            timeout = httpx.Timeout(connect=10.0, read=None, write=60.0, pool=60.0)
            self._client = httpx.AsyncClient(
                transport=transport, base_url="http://worker", timeout=timeout, headers=headers
            )
            self._endpoint = endpoint
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            with contextlib.suppress(Exception):
                await self._client.aclose()
