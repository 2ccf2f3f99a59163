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
    chunk in chunked framing on that socket, one write at a time."""

    def __init__(self, receiver: SocketReceiver, token: bytes, send: Send) -> None:
        self.receiver = receiver
        self.token = token
        self.relay = send
        self.client: socket.socket | None = None
        self.ended = False
        self._lock = asyncio.Lock()  # the heartbeat and the frames may both be writing

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
        try:
            if body:
                await self._write(b"%x\r\n%b\r\n" % (len(body), body))
        except OSError:
            await self._end()  # the client is gone: the app hears of it from this error
            raise
        if not message.get("more_body", False):
            await self._end()

    async def _write(self, frame: bytes) -> None:
        """`frame` on the client's socket: at once when the socket takes it all (a token's
        frame nearly always does); what is left waits for room, and for any write before it."""
        assert self.client is not None
        if not self._lock.locked():
            with contextlib.suppress(BlockingIOError):
                frame = frame[self.client.send(frame) :]
            if not frame:
                return
        async with self._lock:
            await asyncio.get_running_loop().sock_sendall(self.client, frame)

    async def _start(self, message: Message) -> None:
        future = self.receiver.expect(self.token)
        headers = [*message.get("headers", []), (HANDOFF_HEADER, READY)]
        try:
            await self.relay({**message, "headers": headers})
            self.client = await asyncio.wait_for(future, WAIT_FOR_SOCKET_S)
        except TimeoutError:
            self.client = None  # relayed after all
        finally:
            self.receiver.forget(self.token)

    async def _end(self) -> None:
        self.close()
        self.ended = True
        await self.relay({"type": "http.response.body", "body": b"", "more_body": False})

    def close(self) -> None:
        if self.client is not None:
            with contextlib.suppress(OSError):
                self.client.close()  # this process's copy only: the connection stays the front's


def _is_event_stream(message: Message) -> bool:
    if message.get("status") != 200:
        return False
    content_type = header_value(message.get("headers", []), b"content-type") or b""
    return content_type.startswith(b"text/event-stream")
