"""Model routing as pure ASGI middleware: read the body's `model`, lease that model, and hold the
lease until the response body has ended, been cancelled or failed (never longer).

Every POST under /v1/ goes through here: the inference endpoints route by the body's `model`,
the rest lease the active model (when one is resident) so a change never runs on an engine
being drained. The body is
read once and replayed to the handler; the handler finds its stage in the scope
(`http.serving_stage`). A model that cannot be leased answers in the calling protocol's error
shape: 502 `model_load_failed`, 503 `server_closing`, 400 otherwise; a client that leaves while
its model loads gets 499 and leaves no lease behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Mapping
from typing import Any

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from modelhost.inference.contracts import RequestCancelled
from modelhost.residency.router import (
    MODEL_ROUTED,
    ModelRouter,
    model_field,
    operation_for,
    residency_status,
)
from modelhost.residency.unit import ResidencyError
from modelhost.residency.worker_unit import WorkerUnit
from modelhost.server.anthropic_wire import anthropic_error
from modelhost.server.http import STAGE_KEY, ErrorFormatter, replay_body, wait_for_disconnect
from modelhost.server.openai_wire import openai_error
from modelhost.server.responses_wire import responses_error
from modelhost.server.worker_proxy import proxy

RESPONSES = "/v1/responses/"  # GET /v1/responses/{id}: a worker's store may hold it


def error_format_for(path: str) -> ErrorFormatter:
    if path.startswith("/v1/messages"):
        return anthropic_error
    if path.startswith("/v1/responses"):
        return responses_error
    return openai_error


class ModelRouting:
    def __init__(self, app: ASGIApp, router: ModelRouter[Any]) -> None:
        self.app = app
        self.router = router

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and scope["method"] == "GET" and path.startswith(RESPONSES):
            stored = await self.router.stored_response(path)
            if stored is not None:
                await JSONResponse(stored)(scope, receive, send)
                return
        if scope["type"] != "http" or scope["method"] != "POST" or not path.startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        body = await _read_body(receive)
        if body is None:
            return  # the client left before it finished sending
        if path in MODEL_ROUTED:
            try:
                named = model_field(body) or form_model_field(scope, body)
                model_id = self.router.route(named, operation_for(path))
            except ResidencyError as error:
                status, error_body = residency_status(error)
                await _send_error(scope, receive, send, status, error_body)
                return
        else:
            # Anything else model-scoped is the active model's, and never loads one: with
            # nothing resident the path falls through to the app as it is.
            active = self.router.active()
            if active is None:
                await self.app(scope, replay_body(body, receive), send)
                return
            model_id = active.model_id
        acquiring = asyncio.create_task(self.router.acquire(model_id))
        gone = asyncio.create_task(wait_for_disconnect(receive))
        await asyncio.wait({acquiring, gone}, return_when=asyncio.FIRST_COMPLETED)
        if gone.done():
            acquiring.cancel()  # the host forgets a waiter that is cancelled
            with contextlib.suppress(BaseException):
                lease = await acquiring
                lease.release()
            cancelled = RequestCancelled()
            await _send_error(scope, receive, send, cancelled.status, cancelled.body)
            return
        gone.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await gone
        try:
            lease = acquiring.result()
        except ResidencyError as error:
            status, error_body = residency_status(error)
            await _send_error(scope, receive, send, status, error_body)
            return

        async def send_then_release(message: Message) -> None:
            try:
                await send(message)
            finally:
                if message["type"] == "http.response.body" and not message.get("more_body"):
                    lease.release()  # the body has ended

        try:
            if isinstance(lease.unit, WorkerUnit):  # a worker process serves this model
                formatter = error_format_for(path)
                await proxy(lease.unit, scope, body, receive, send_then_release, formatter)
                return
            scope = {**scope, STAGE_KEY: lease.unit.stage}
            await self.app(scope, replay_body(body, receive), send_then_release)
        finally:
            lease.release()  # cancelled or failed before its body ended


_FORM_MODEL = re.compile(rb'name="model"\r\n(?:[^\r\n]*\r\n)*?\r\n([^\r\n]{1,256})\r\n')


def form_model_field(scope: Scope, body: bytes) -> str | None:
    """The `model` field of a multipart form (what OpenAI's SDKs send for audio), or None."""
    headers = dict(scope.get("headers", []))
    if not headers.get(b"content-type", b"").startswith(b"multipart/form-data"):
        return None
    found = _FORM_MODEL.search(body)
    return found.group(1).decode("utf-8", "replace") if found else None


async def _read_body(receive: Receive) -> bytes | None:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def _send_error(
    scope: Scope, receive: Receive, send: Send, status: int, body: Mapping[str, Any]
) -> None:
    response = error_format_for(scope["path"])(status, body)
    with contextlib.suppress(OSError):
        await response(scope, receive, send)
