"""The HTTP end of the pipeline: error mapping, the JSON responder and the SSE writer.

Error mapping, checked in this order:

| condition                       | status | body                                              |
| ------------------------------- | ------ | ------------------------------------------------- |
| the client is gone              | 499    | request_cancelled (never logged as a server error) |
| RequestError (400/429/501/503…) | its own| its own body (memory_admission, queue_full, …)     |
| anything else                   | 500    | {message}, with the stack logged                   |

A stream that fails after it opened ends with the surface's error frame and nothing after it.
While a stream has nothing to send, a `: keep-alive` comment goes out every `heartbeat_s`.
Every request ends with exactly one log line: id, status, tokens, TTFT and total time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.types import Message, Receive, Scope, Send

from modelhost.inference.contracts import (
    CompletionEvent,
    EngineUnavailable,
    InferenceResult,
    InvalidRequest,
    RequestCancelled,
    RequestError,
)
from modelhost.inference.encoder_ids import embedding_model_only, is_encoder
from modelhost.inference.media import check_media_sizes
from modelhost.server.edge.request_context import RequestOutcome, current_request

if TYPE_CHECKING:
    from modelhost.inference.stage import AdmittedRequest, InferenceStage

logger = logging.getLogger("modelhost.server")

HEARTBEAT = ": keep-alive\n\n"
EVENT_STREAM = "text/event-stream; charset=utf-8"
SSE_HEADERS = {"cache-control": "no-cache", "connection": "keep-alive"}

ErrorFormatter = Callable[[int, Mapping[str, Any]], Response]


@dataclass(frozen=True, slots=True)
class ErrorShape:
    """How a protocol writes a refusal: as a JSON response, and as the one SSE frame that ends
    a stream which broke after it opened."""

    response: ErrorFormatter
    stream_frame: Callable[[int, Mapping[str, Any]], str]


STAGE_KEY = "modelhost.stage"  # where the leasing middleware leaves the leased unit's stage
# What the front spent on a request before its worker got it (leasing: a load, a wait for
# room), in milliseconds: the front sends it, a worker's surface counts it in the durations it
# reports (Ollama's load_duration and total_duration).
FRONT_WAITED_HEADER = "x-modelhost-front-waited-ms"


def serving_stage(request: Request, model: str | None = None) -> InferenceStage:
    """The stage that answers this request. With several models, the leasing middleware has
    already leased the one the body's `model` names and left its stage in the scope; a read
    that leased nothing gets the active model's stage. An embedded encoder named here is a
    400: it serves /v1/embeddings only."""
    if is_encoder(model):
        raise embedding_model_only(str(model))
    leased: InferenceStage | None = request.scope.get(STAGE_KEY)
    if leased is not None:
        return leased
    router = getattr(request.app.state, "router", None)
    if router is None:
        stage: InferenceStage = request.app.state.stage
        return stage
    unit = router.active()
    if unit is None:
        raise EngineUnavailable("no model is resident; name one in a request to load it")
    return unit.stage


async def read_json_object(request: Request) -> dict[str, Any]:
    """The request body as a JSON object; anything else is a 400 `invalid JSON body`. Inline
    images and audio over the server's caps are 400s too (the body's own size and shape were
    capped at the edge, `limits.BodyLimits`)."""
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise InvalidRequest("invalid JSON body") from None
    if not isinstance(body, dict):
        raise InvalidRequest("invalid JSON body")
    settings = request.app.state.settings
    check_media_sizes(
        body,
        max_image_bytes=settings.max_image_bytes,
        max_audio_bytes=settings.max_audio_bytes,
    )
    return body


# ---------------------------------------------------------------------------------------------
# Error mapping


def error_status_body(exc: BaseException, context: str, *, client_gone: bool) -> tuple[int, dict]:
    """(status, neutral body) for an exception, per the mapping table above."""
    if client_gone or isinstance(exc, RequestCancelled | ClientDisconnect):
        cancelled = RequestCancelled()
        return cancelled.status, dict(cancelled.body)
    if isinstance(exc, RequestError):
        return exc.status, dict(exc.body)
    message = _message_of(exc)
    logger.error("500 on %s", context, exc_info=(type(exc), exc, exc.__traceback__))
    return 500, {"message": message}


def _message_of(exc: BaseException) -> str:
    try:
        return str(exc) or type(exc).__name__
    except Exception:
        return "Unknown error"


def error_response(
    exc: BaseException,
    context: str,
    format_error: ErrorFormatter,
    log: RequestLog | None = None,
    *,
    client_gone: bool = False,
) -> Response:
    status, body = error_status_body(exc, context, client_gone=client_gone)
    if log is not None:
        log.finish(status)
    return format_error(status, body)


def warning_headers(admitted: AdmittedRequest | None) -> dict[str, str]:
    if admitted is None or not admitted.warnings:
        return {}
    return {"warning": ", ".join(admitted.warnings)}


def front_waited_s(request: Request) -> float:
    """Seconds the front held this request before forwarding it to this worker (0 elsewhere:
    a client's header of that name means nothing)."""
    if request.app.state.settings.owner != "worker":
        return 0.0
    try:
        waited = float(request.headers.get(FRONT_WAITED_HEADER, "0")) / 1000
    except ValueError:
        return 0.0
    return waited if math.isfinite(waited) and waited > 0 else 0.0


# ---------------------------------------------------------------------------------------------
# The request log


class RequestLog:
    """Collects one request's outcome and writes its single log line.

    Inside the app's edge layer it reports to the request's context too (metrics, and the
    `x-request-id` the response carries); its clock then starts when the request arrived."""

    def __init__(self, request_id: str, route: str, clock: Callable[[], float] = time.monotonic):
        self.request_id = request_id
        self.route = route
        self.clock = clock
        self.context = current_request()
        arrived = self.context is not None and clock is time.monotonic
        self.started_at = self.context.arrived_at if arrived else clock()  # type: ignore[union-attr]
        self._admitted: AdmittedRequest | None = None
        self.admitted_at: float | None = None
        self.status: int | None = None
        self.status_hint = 200  # what a stream that ends on its own reports
        self.notes: dict[str, str] = {}  # extra `key=value` fields for the line (tools not offered)

    @property
    def admitted(self) -> AdmittedRequest | None:
        return self._admitted

    @admitted.setter
    def admitted(self, admitted: AdmittedRequest | None) -> None:
        self._admitted = admitted
        self.admitted_at = self.clock()
        if self.context is not None:
            self.context.admitted = admitted  # the live view reads its tokens as they come

    def finish(self, status: int) -> None:
        if self.status is not None:
            return
        self.status = status
        now = self.clock()
        outcome = self._outcome(status, now)
        context = self.context
        if context is not None:
            context.status, context.logged = status, True
            context.outcome = outcome
            if context.metrics is not None:
                context.metrics.observe_request(outcome)
        request_id = context.request_id if context is not None else "-"
        ttft_ms = "-" if outcome.ttft_s is None else f"{outcome.ttft_s * 1000:.1f}"
        notes = "".join(f" {key}={value}" for key, value in self.notes.items())
        logger.info(
            "%s %s %d prompt_tokens=%s completion_tokens=%s ttft_ms=%s total_ms=%.1f request_id=%s"
            "%s",
            self.request_id,
            self.route,
            status,
            "-" if outcome.prompt_tokens is None else outcome.prompt_tokens,
            "-" if outcome.completion_tokens is None else outcome.completion_tokens,
            ttft_ms,
            outcome.total_s * 1000,
            request_id,
            notes,
            extra={"request": {**self._fields(outcome, request_id), **self.notes}},
        )

    def _outcome(self, status: int, now: float) -> RequestOutcome:
        admitted = self._admitted
        prompt = completion = ttft = gap = queue = None
        if admitted is not None:
            prompt, completion = admitted.prompt_tokens, admitted.completion_tokens
            first = admitted.first_token_at
            if first is not None:
                ttft = first - self.started_at
                if completion > 1:
                    gap = (now - first) / (completion - 1)
            if self.admitted_at is not None:
                queue = self.admitted_at - self.started_at
        return RequestOutcome(self.route, status, prompt, completion, ttft, gap, queue,
                              now - self.started_at)  # fmt: skip

    def _fields(self, outcome: RequestOutcome, request_id: str) -> dict[str, Any]:
        method, _, path = self.route.partition(" ")
        ms = {
            "ttft_ms": outcome.ttft_s,
            "queue_ms": outcome.queue_s,
            "total_ms": outcome.total_s,
        }
        return {
            "request_id": request_id,
            "id": self.request_id,
            "method": method,
            "path": path,
            "status": outcome.status,
            "prompt_tokens": outcome.prompt_tokens,
            "completion_tokens": outcome.completion_tokens,
            **{key: None if s is None else round(s * 1000, 1) for key, s in ms.items()},
        }


# ---------------------------------------------------------------------------------------------
# JSON


async def wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def respond_json(
    request: Request,
    admitted: AdmittedRequest,
    render: Callable[[InferenceResult], Mapping[str, Any]],
    format_error: ErrorFormatter,
    log: RequestLog,
    *,
    headers: Mapping[str, str] | None = None,
) -> Response:
    """Run the admitted request to its result; a client that leaves first cancels the row;
    `headers` go on the answer."""
    run = asyncio.create_task(admitted.run())
    gone = asyncio.create_task(wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({run, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not run.done():
            raise RequestCancelled()
        body = render(run.result())
        log.finish(200)
        return JSONResponse(body, headers={**(headers or {}), **warning_headers(admitted)})
    except asyncio.CancelledError:  # a forced shutdown cut this request short
        log.finish(503)
        raise
    except Exception as exc:
        client_gone = gone.done() and not run.done()
        return error_response(exc, log.request_id, format_error, log, client_gone=client_gone)
    finally:
        admitted.cancel()
        for task in (run, gone):
            task.cancel()
        await asyncio.wait({run, gone})


# ---------------------------------------------------------------------------------------------
# SSE


class StreamProtocol(Protocol):
    """A surface's SSE frames: an opening, one or more frames per event, and the end."""

    def start(self) -> list[str]: ...

    def delta(self, event: CompletionEvent) -> list[str]: ...

    def finish(self, event: CompletionEvent) -> list[str]: ...

    def error(self, status: int, body: Mapping[str, Any]) -> list[str]: ...


def respond_stream(
    request: Request,
    admitted: AdmittedRequest,
    protocol: StreamProtocol,
    log: RequestLog,
    *,
    heartbeat: str = HEARTBEAT,
    content_type: str = EVENT_STREAM,
    headers: Mapping[str, str] | None = None,
) -> EventStreamResponse:
    """Stream `protocol`'s frames for `admitted`, with the server's heartbeat interval;
    `heartbeat` is the surface's keep-alive frame (a comment by default; Anthropic clients
    expect a `ping` event); `content_type`, its stream's (SSE, or Ollama's NDJSON); `headers`
    go on the response."""
    heartbeat_s: float = request.app.state.settings.heartbeat_s

    async def frames() -> AsyncIterator[str]:
        try:
            for frame in protocol.start():
                yield frame
            async for event in admitted.events():
                for frame in protocol.finish(event) if event.is_terminal else protocol.delta(event):
                    yield frame
            log.status_hint = 200
        except Exception as exc:
            status, body = error_status_body(exc, log.request_id, client_gone=False)
            log.status_hint = status
            for frame in protocol.error(status, body):
                yield frame
        finally:
            admitted.cancel()

    def done(status: int | None) -> None:
        admitted.cancel()
        log.finish(log.status_hint if status is None else status)

    return EventStreamResponse(
        frames(),
        heartbeat_s=heartbeat_s,
        headers={**SSE_HEADERS, **(headers or {}), **warning_headers(admitted)},
        on_done=done,
        heartbeat=heartbeat,
        content_type=content_type,
    )


class EventStreamResponse:
    """An ASGI stream of frames (`text/event-stream` unless told) that stops them when the
    client leaves.

    `on_done` gets 499 when the client left, 503 when the server cancelled the request (a
    forced shutdown), 500 when writing failed, and None when the stream ended on its own.
    """

    def __init__(
        self,
        frames: AsyncIterator[str],
        *,
        heartbeat_s: float,
        headers: Mapping[str, str],
        on_done: Callable[[int | None], None],
        heartbeat: str = HEARTBEAT,
        content_type: str = EVENT_STREAM,
    ) -> None:
        self.frames = frames
        self.heartbeat_s = heartbeat_s
        self.heartbeat = heartbeat
        self.headers = {"content-type": content_type, **headers}
        self.on_done = on_done

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        loop = asyncio.get_running_loop()
        last_write = loop.time()

        async def write_frame(frame: str) -> None:
            nonlocal last_write
            await send({"type": "http.response.body", "body": frame.encode(), "more_body": True})
            last_write = loop.time()

        async def keep_alive() -> None:
            """The heartbeat whenever no frame went out for `heartbeat_s`. One timer for the
            stream: racing a timeout against each frame cost a task and a wait a token."""
            with contextlib.suppress(OSError):  # the peer is gone: the listener reports it
                while True:
                    await asyncio.sleep(last_write + self.heartbeat_s - loop.time())
                    if loop.time() - last_write >= self.heartbeat_s:
                        await write_frame(self.heartbeat)

        async def write() -> None:
            nonlocal last_write
            headers = [(k.encode(), v.encode()) for k, v in self.headers.items()]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            last_write = loop.time()
            beats = asyncio.create_task(keep_alive())
            try:
                async for frame in self.frames:
                    await write_frame(frame)
            finally:
                beats.cancel()
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        writer = asyncio.create_task(write())
        listener = asyncio.create_task(wait_for_disconnect(receive))
        status: int | None = 503  # unless the wait below ends: the server cancelled us
        try:
            status = await race_the_client(writer, listener)
        finally:
            for task in (writer, listener):
                task.cancel()
            self.on_done(status)  # first, and synchronously: the row is cancelled whatever follows
            await asyncio.wait({writer, listener})
            with contextlib.suppress(RuntimeError):
                await self.frames.aclose()  # type: ignore[attr-defined]
        if status == 500:
            writer.result()  # a bug in writing: let the server log it


# A client that closes as soon as it has read a stream's last event (Codex after
# `response.completed`) leaves while the body's end is still on its way: this long a grace tells
# that from a client leaving mid-stream, whose row then runs this much longer.
END_GRACE_S = 0.1


async def race_the_client(writer: asyncio.Task[None], listener: asyncio.Task[None]) -> int | None:
    """Wait for the stream's `writer` or the client's disconnect `listener`, then the stream's
    final status (stream_status). A client that left gets END_GRACE_S for the writer to end on
    its own: then the whole answer was delivered, and it is not a 499."""
    await asyncio.wait({writer, listener}, return_when=asyncio.FIRST_COMPLETED)
    if not writer.done():
        await asyncio.wait({writer}, timeout=END_GRACE_S)
    return stream_status(writer)


def stream_status(writer: asyncio.Task[None]) -> int | None:
    """The final status of a stream whose writer raced the client's disconnect: 499 when the
    client left, 503 when the server cancelled the writer, 500 for a bug in writing, None
    when the stream ended on its own."""
    if not writer.done():
        return 499  # the client left first
    if writer.cancelled():
        return 503
    error = writer.exception()
    if isinstance(error, OSError):
        return 499  # the server could not write: the peer is gone
    return None if error is None else 500


def replay_body(body: bytes, receive: Receive) -> Receive:
    """`receive` for an app downstream: the body already read, then the client's own messages."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
