"""Model leasing as pure ASGI middleware: read the body's `model`, lease that model, and hold the
lease until the response body has ended, been cancelled or failed (never longer).

Every POST under /v1/ and every model-routed path goes through here: the surfaces' model-routed
paths route by the body's `model` (a surface with its own model names resolves them first, an
unknown one refused; its `keep_alive`, when a body asks one, is set on the leased model), the rest
lease the active model (when one is resident) so a change never runs on an
engine being drained. The body is read once and replayed to the handler (or proxied to the
worker process that serves the model); the handler finds its stage in the scope
(`http.serving_stage`). A model that cannot be leased answers in the calling protocol's error
shape: 502 `model_load_failed`, 503 `server_closing`, 404 `model_not_found` (a reranker
that is not local), 400 otherwise; a client that leaves while
its model loads gets 499 and leaves no lease behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from modelhost.inference.contracts import RequestCancelled, RequestError
from modelhost.residency.router import ModelRouter
from modelhost.residency.unit import ResidencyError
from modelhost.residency.workers.worker_unit import WorkerUnit
from modelhost.server.edge.request_context import current_request
from modelhost.server.front.worker_proxy import Forwarded, proxy
from modelhost.server.http import STAGE_KEY, ErrorShape, replay_body, wait_for_disconnect

if TYPE_CHECKING:
    from modelhost.server.surfaces import Surfaces


class ModelLeasing:
    def __init__(self, app: ASGIApp, router: ModelRouter[Any], surfaces: Surfaces) -> None:
        self.app = app
        self.router = router
        self.surfaces = surfaces

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        operation = self.surfaces.operation(path)
        leased = path.startswith("/v1/") or operation is not None
        if scope["type"] != "http" or scope["method"] != "POST" or not leased:
            await self.app(scope, receive, send)
            return
        body = await _read_body(receive)
        if body is None:
            return  # the client left before it finished sending
        errors = self.surfaces.errors_for(path)
        if operation is not None:
            try:
                named = model_field(body) or form_model_field(scope, body)
                names = self.surfaces.model_names(path)
                value = _json_object(body)
                if names is not None and value is not None:  # its own names; unknown: refused
                    registry, adapters = self.router.registry, self.router.adapters
                    named = names(
                        value.get("model"),
                        lambda i: registry.get(i) is not None or adapters.get(i) is not None,
                    )
                model_id = self.router.route(named, operation)
            except ResidencyError as error:
                await _refuse(scope, receive, send, errors, *residency_status(error))
                return
            except RequestError as error:
                await _refuse(scope, receive, send, errors, error.status, error.body)
                return
        else:
            # Anything else model-scoped is the active model's, and never loads one: with
            # nothing resident the path falls through to the app as it is.
            active = self.router.active()
            if active is None:
                await self.app(scope, replay_body(body, receive), send)
                return
            model_id = active.model_id
        context = current_request()
        if context is not None:
            context.model = model_id  # the live view's model column
        # A cluster's replicas are chosen by the conversation's prefix, read from the body.
        acquiring = asyncio.create_task(self.router.acquire(model_id, body=body))
        gone = asyncio.create_task(wait_for_disconnect(receive))
        await asyncio.wait({acquiring, gone}, return_when=asyncio.FIRST_COMPLETED)
        if gone.done():
            acquiring.cancel()  # the host forgets a waiter that is cancelled
            with contextlib.suppress(BaseException):
                lease = await acquiring
                lease.release()
            cancelled = RequestCancelled()
            await _refuse(scope, receive, send, errors, cancelled.status, cancelled.body)
            return
        gone.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await gone
        try:
            lease = acquiring.result()
        except ResidencyError as error:
            await _refuse(scope, receive, send, errors, *residency_status(error))
            return
        keep_alive = self.surfaces.keep_alive(path, body)
        if keep_alive is not None:  # how long the model stays once this response has ended
            self.router.host.keep_alive(model_id, keep_alive)

        async def send_then_release(message: Message) -> None:
            try:
                await send(message)
            finally:
                if message["type"] == "http.response.body" and not message.get("more_body"):
                    lease.release()  # the body has ended

        try:
            forward = self.surfaces.forward(path)
            if isinstance(lease.unit, WorkerUnit) and forward is not None:
                # The lease holds until the front has settled what it keeps of the answer, and
                # the body ends only after that: a client that has read the whole answer can
                # name it at once, even if the worker dies the next moment. So the front writes
                # the stream itself rather than handing it to the worker.
                forwarded = await forward(scope, body)
                settled = False

                async def settle() -> None:
                    nonlocal settled
                    if not settled:
                        settled = True
                        await forwarded.settle(lease.unit)

                async def send_settled(message: Message) -> None:
                    if message["type"] == "http.response.body" and not message.get("more_body"):
                        await settle()
                    await send(message)

                try:
                    await proxy(
                        lease.unit, _with(scope, forwarded), forwarded.body, receive,
                        send_settled, errors, hand_off=False,
                    )  # fmt: skip
                finally:
                    await settle()
                return
            if isinstance(lease.unit, WorkerUnit):  # a worker process serves this model
                await proxy(lease.unit, scope, body, receive, send_then_release, errors)
                return
            scope = {**scope, STAGE_KEY: lease.unit.stage}
            await self.app(scope, replay_body(body, receive), send_then_release)
        finally:
            lease.release()  # cancelled or failed before its body ended


def model_field(body: bytes) -> str | None:
    """The routing key of a buffered body: a JSON object's string `model`, else None (the
    current model answers, and its own parser refuses a malformed body)."""
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    model = value.get("model") if isinstance(value, dict) else None
    return model if isinstance(model, str) else None


def _json_object(body: bytes) -> dict[str, Any] | None:
    """A buffered body as a JSON object; None when it is not one (its handler answers that)."""
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    return value if isinstance(value, dict) else None


def _with(scope: Scope, forwarded: Forwarded) -> Scope:
    """`scope` with the forwarded request's headers in place of the client's of those names."""
    names = {name for name, _ in forwarded.headers}
    kept = [(k, v) for k, v in scope.get("headers", []) if k.lower() not in names]
    return {**scope, "headers": [*kept, *forwarded.headers]}


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


async def _refuse(
    scope: Scope,
    receive: Receive,
    send: Send,
    errors: ErrorShape,
    status: int,
    body: Mapping[str, Any],
) -> None:
    response = errors.response(status, body)
    with contextlib.suppress(OSError):
        await response(scope, receive, send)


def residency_status(error: ResidencyError) -> tuple[int, dict[str, Any]]:
    """(status, neutral body) of a model that could not be leased."""
    if error.code == "load-failed":
        status, kind = 502, "model_load_failed"
    elif error.code == "closed":
        status, kind = 503, "server_closing"
    elif error.code == "unknown-model":
        status, kind = 404, "invalid_request_error"
    else:
        status, kind = 400, "invalid_request_error"
    code = "model_not_found" if error.code == "unknown-model" else error.code  # OpenAI's word
    body = {"message": error.message, "type": kind, "code": code}
    if error.code in ("wrong-operation", "unsupported-model", "unknown-model"):
        body["param"] = "model"
    return status, body
