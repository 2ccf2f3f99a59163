"""The parent's HTTP transport to a worker's UNIX socket, on asyncio's own streams.

httpx reaches a UNIX socket through anyio's raw-socket stream, which registers and removes
the socket with the event loop around every read: two extra system calls for each chunk of a
proxied stream, one chunk per generated token. An asyncio stream keeps the socket registered
and its transport reads into a buffer. On these virtual machines that took the relay's CPU
from ~330 to ~240 us a streamed chunk (benchmarks/README.md). Errors map onto httpcore's
exceptions as its own backends do, so httpx raises the same TransportErrors to the proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Iterable
from typing import Any

import httpcore
import httpx


class _AsyncioStream(httpcore.AsyncNetworkStream):
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        try:
            if timeout is None:  # a relayed stream's reads (no read timeout): one a token
                return await self._reader.read(max_bytes)
            async with asyncio.timeout(timeout):
                return await self._reader.read(max_bytes)
        except TimeoutError as exc:
            raise httpcore.ReadTimeout(str(exc)) from exc
        except OSError as exc:
            raise httpcore.ReadError(str(exc)) from exc

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        try:
            async with asyncio.timeout(timeout):
                self._writer.write(buffer)
                await self._writer.drain()
        except TimeoutError as exc:
            raise httpcore.WriteTimeout(str(exc)) from exc
        except OSError as exc:
            raise httpcore.WriteError(str(exc)) from exc

    async def aclose(self) -> None:
        self._writer.close()
        with contextlib.suppress(OSError):
            await self._writer.wait_closed()

    async def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("a worker's socket speaks plain HTTP")

    def get_extra_info(self, info: str) -> Any:
        if info == "is_readable":  # asked of idle connections: the worker closed its end
            return self._reader.at_eof()
        if info == "socket":
            return self._writer.get_extra_info("socket")
        return None


class AsyncioUnixBackend(httpcore.AsyncNetworkBackend):
    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_unix_connection(path)
        except TimeoutError as exc:
            raise httpcore.ConnectTimeout(str(exc)) from exc
        except OSError as exc:
            raise httpcore.ConnectError(str(exc)) from exc
        return _AsyncioStream(reader, writer)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


def worker_transport(socket_path: str) -> httpx.AsyncHTTPTransport:
    """httpx's transport to `socket_path`, its connections on AsyncioUnixBackend."""
    transport = httpx.AsyncHTTPTransport(uds=socket_path)
    # httpx takes no network backend of its own, so its pool is swapped for an equal one
    # on ours; should a later httpx keep its pool elsewhere, anyio's streams stay.
    if isinstance(getattr(transport, "_pool", None), httpcore.AsyncConnectionPool):
        limits = httpx.Limits()  # httpx's defaults, as its own pool had them
        transport._pool = httpcore.AsyncConnectionPool(
            uds=socket_path,
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            network_backend=AsyncioUnixBackend(),
        )
    return transport
