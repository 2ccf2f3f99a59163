"""A worker's event stream written straight to the client's socket, past the front's relay.

Relayed, every streamed token crossed two event loops: the worker's wrote it to the front, and
the front's read it and wrote it again, ~200 us of the front's CPU a token on two cores, taken
from the kernels' threads. Instead, when a client speaking HTTP/1.1 gets an event stream:

1. the front asks for the handoff: its request to the worker carries `x-modelhost-handoff:
   TOKEN`;
2. the worker answers the stream's head with `x-modelhost-handoff: ready` and waits;
3. the front writes the head to the client (chunked), then passes the client's socket to the
   worker over the worker's handoff socket (SCM_RIGHTS), tagged with TOKEN, or declines;
4. the worker writes each body chunk to that socket itself, in the chunked framing the head
   announced, and ends its answer to the front with no body;
5. the front writes the last chunk, so the connection stays the front's: keep-alive, the next
   request, the client leaving (it still reads the socket) and a worker that dies mid-stream
   (the front writes the protocol's error frame) work as before.

A declined, failed or late handoff leaves the stream relayed as before. JSON answers, HEAD and
HTTP/1.0 clients are always relayed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

HANDOFF_HEADER = b"x-modelhost-handoff"
READY = b"ready"
HANDOFF_SOCKET = "handoff.sock"  # beside the worker's HTTP socket, in its private directory
TOKEN_BYTES = 32  # hex of 16 random bytes
WAIT_FOR_SOCKET_S = 5.0  # the front answers at once; after this the stream is relayed
STREAM_TYPES = (b"text/event-stream", b"application/x-ndjson")  # what is handed off
HIGH_WATER_BYTES = 65536  # a slow client's bytes waiting in the worker before the stream waits


def handoff_socket_path(socket_path: str) -> str:
    return os.path.join(os.path.dirname(socket_path), HANDOFF_SOCKET)


def header_value(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for key, value in headers:
        if key.lower() == name:
            return value
    return None


# ---------------------------------------------------------------------------------------------
# The front's side


def pass_socket(path: str, token: bytes, fd: int | None) -> bool:
    """Send the worker at `path` the socket `fd` for the stream `token`, or decline it (None).
    False when the worker could not be told; never blocks (a full backlog is a refusal)."""
    channel = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    channel.setblocking(False)
    try:
        channel.connect(path)
        sent = socket.send_fds(channel, [token], [] if fd is None else [fd])
        return sent == len(token)
    except OSError:
        return False
    finally:
        channel.close()


# ---------------------------------------------------------------------------------------------
# The worker's side


class SocketReceiver:
    """The worker's handoff socket: the client sockets the front passes, by stream token."""

    def __init__(self, listener: socket.socket) -> None:
        listener.setblocking(False)
        self.listener = listener
        self._waiting: dict[bytes, asyncio.Future[socket.socket | None]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def expect(self, token: bytes) -> asyncio.Future[socket.socket | None]:
        """A future for `token`'s socket (None: declined); call before the front can send it."""
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
            loop.add_reader(self.listener.fileno(), self._accept)
        future: asyncio.Future[socket.socket | None] = loop.create_future()
        self._waiting[token] = future
        return future

    def forget(self, token: bytes) -> None:
        self._waiting.pop(token, None)

    def _accept(self) -> None:
        try:
            channel, _ = self.listener.accept()
        except OSError:
            return
        channel.setblocking(False)
        assert self._loop is not None
        self._loop.add_reader(channel.fileno(), self._read, channel)

    def _read(self, channel: socket.socket) -> None:
        try:
            token, fds, _, _ = socket.recv_fds(channel, TOKEN_BYTES, 1, socket.MSG_CMSG_CLOEXEC)
        except BlockingIOError:
            return
        except OSError:
            token, fds = b"", []
        assert self._loop is not None
        self._loop.remove_reader(channel.fileno())
        channel.close()
        client = socket.socket(fileno=fds[0]) if fds else None
        if client is not None:
            client.setblocking(False)  # already so: the front's event loop owns it too
        future = self._waiting.pop(token, None)
        if future is None or future.done():
            if client is not None:
                client.close()  # its stream has ended already
            return
        future.set_result(client)

    def close(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self.listener.fileno())
        self.listener.close()


class StreamHandoff:
    """The worker's middleware: an event stream the front asked to hand off goes to the
    client's socket once the front has passed it; everything else goes out unchanged."""

    def __init__(self, app: ASGIApp, receiver: SocketReceiver) -> None:
        self.app = app
        self.receiver = receiver

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        token = None
        if scope["type"] == "http":
            token = header_value(scope.get("headers", []), HANDOFF_HEADER)
        if token is None:
            await self.app(scope, receive, send)
            return
        writer = _HandedStream(self.receiver, token, send)
        try:
            await self.app(scope, receive, writer.send)
        finally:
            writer.close()


class _HandedStream:
    """One request's `send`: relayed until the front passes the client's socket, then each body
    chunk in chunked framing on that socket."""

    def __init__(self, receiver: SocketReceiver, token: bytes, send: Send) -> None:
        self.receiver = receiver
        self.token = token
        self.relay = send
        self.client: ClientWriter | None = None
        self.ended = False

    async def send(self, message: Message) -> None:
        if self.ended:
            return
        if self.client is None:
            if message["type"] == "http.response.start" and _is_event_stream(message):
                await self._start(message)
            else:
                await self.relay(message)
            return
        body: bytes = message.get("body", b"")
        more = message.get("more_body", False)
        try:
            if body:
                self.client.write(b"%x\r\n%b\r\n" % (len(body), body))
            await self.client.drain(0 if not more else HIGH_WATER_BYTES)
        except OSError:
            await self._end()  # the client is gone: the app hears of it from this error
            raise
        if not more:
            await self._end()

    async def _start(self, message: Message) -> None:
        future = self.receiver.expect(self.token)
        headers = [*message.get("headers", []), (HANDOFF_HEADER, READY)]
        try:
            await self.relay({**message, "headers": headers})
            client = await asyncio.wait_for(future, WAIT_FOR_SOCKET_S)
        except TimeoutError:
            client = None  # relayed after all
        finally:
            self.receiver.forget(self.token)
        if client is not None:
            self.client = ClientWriter(client)

    async def _end(self) -> None:
        self.close()
        self.ended = True
        await self.relay({"type": "http.response.body", "body": b"", "more_body": False})

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


class ClientWriter:
    """Bytes to the client's socket, in order and never half a write: what the socket does not
    take at once (a slow client) waits here and goes out as it has room, so a sender that is
    cancelled meanwhile (the heartbeat, at the stream's end) leaves no half chunk behind."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.pending = bytearray()
        self.failed: OSError | None = None
        self._empty = asyncio.Event()
        self._empty.set()
        self._loop = asyncio.get_running_loop()

    def write(self, data: bytes) -> None:
        if self.failed is not None:
            raise self.failed
        if not self.pending:
            try:
                data = data[self.sock.send(data) :]
            except BlockingIOError:
                pass
            except OSError as exc:
                self.failed = exc
                raise
            if not data:
                return  # a token's chunk nearly always goes out here, at once
            self._empty.clear()
            self._loop.add_writer(self.sock.fileno(), self._flush)
        self.pending += data

    async def drain(self, limit: int) -> None:
        """Wait while more than `limit` bytes are waiting; raise when the client is gone."""
        if len(self.pending) > limit:
            await self._empty.wait()
        if self.failed is not None:
            raise self.failed

    def _flush(self) -> None:
        try:
            del self.pending[: self.sock.send(self.pending)]
        except BlockingIOError:
            return
        except OSError as exc:
            self.failed = exc
            self.pending.clear()
        if not self.pending:
            self._loop.remove_writer(self.sock.fileno())
            self._empty.set()

    def close(self) -> None:
        """Close this process's copy of the socket (the connection stays the front's)."""
        if self.pending:  # the stream was cancelled with bytes still waiting: they are dropped
            self._loop.remove_writer(self.sock.fileno())
            self.pending.clear()
        with contextlib.suppress(OSError):
            self.sock.close()


def is_stream_type(content_type: bytes) -> bool:
    """A stream of frames: SSE, or Ollama's NDJSON."""
    return content_type.startswith(STREAM_TYPES)


def _is_event_stream(message: Message) -> bool:
    if message.get("status") != 200:
        return False
    return is_stream_type(header_value(message.get("headers", []), b"content-type") or b"")
