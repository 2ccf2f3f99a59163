"""Ollama's `POST /api/pull {"model", "stream", "insecure"}`: a model from the Hugging Face hub
(residency/pull/), streamed as Ollama streams a pull: `pulling manifest`, `pulling <digest>`
lines with `digest`, `total` and `completed` for each file, `verifying sha256 digest`,
`writing manifest`, `success`. With `stream: false`, one `{"status": "success"}`.

What fails before the download starts (a name that is no repo, an unknown or gated repo, a
model modelhost cannot serve, a full disk) is an `{"error"}` with its status; what fails later,
one `{"error"}` line ending the stream. A client that leaves cancels the pull, which leaves
nothing listed. `insecure` is accepted and changes nothing: the hub is reached over the
`HF_ENDPOINT` URL as it is. Pulling is an operator action (edge/access.py): a
`--cors-origin` page does not reach it. Once pulled, the registry rescans, so the model is
listed and served at once.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from modelhost.inference.contracts import InvalidRequest, RequestError
from modelhost.residency.pull.plan import PullPlan
from modelhost.residency.pull.puller import PullCancelled, PullProgress, fetch, prepare
from modelhost.residency.pull.reference import PullError
from modelhost.server.http import EventStreamResponse, RequestLog, read_json_object
from modelhost.server.ollama import wire

SUCCESS = PullProgress("success")


class _Ended:
    """The download's end: None, or why it failed."""

    def __init__(self, error: PullError | None) -> None:
        self.error = error


async def pull(request: Request) -> Response | EventStreamResponse:
    log = RequestLog(wire.new_id(), "POST /api/pull")
    try:
        body = await read_json_object(request)
        stream = body.get("stream", True)
        if not isinstance(stream, bool):
            raise InvalidRequest("stream must be a boolean", param="stream")
        if not isinstance(body.get("insecure", False), bool):
            raise InvalidRequest("insecure must be a boolean", param="insecure")
    except RequestError as error:
        log.finish(error.status)
        return wire.ollama_error(error.status, error.body)
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[PullProgress | _Ended] = asyncio.Queue()

    def report(progress: PullProgress) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, progress)

    try:
        plan = await asyncio.to_thread(prepare, body.get("model", body.get("name")), report)
    except PullError as error:
        log.finish(error.status)
        return wire.ollama_error(error.status, {"message": error.message})
    cancel = threading.Event()
    download = asyncio.create_task(_download(request, plan, report, cancel, queue))
    if not stream:
        try:
            ended = await download
        except asyncio.CancelledError:
            cancel.set()
            raise
        if ended.error is not None:
            log.finish(ended.error.status)
            return wire.ollama_error(ended.error.status, {"message": ended.error.message})
        log.finish(200)
        return JSONResponse(SUCCESS.as_json())

    async def frames() -> AsyncIterator[str]:
        try:
            while True:
                item = await queue.get()
                if isinstance(item, PullProgress):
                    yield wire.line(item.as_json())
                    continue
                if item.error is not None:
                    log.status_hint = item.error.status
                    yield wire.line({"error": item.error.message})
                else:
                    yield wire.line(SUCCESS.as_json())
                return
        finally:
            cancel.set()  # a client gone mid-pull: the download stops at its next chunk

    def done(status: int | None) -> None:
        cancel.set()
        log.finish(log.status_hint if status is None else status)

    return EventStreamResponse(
        frames(),
        heartbeat_s=request.app.state.settings.heartbeat_s,
        headers={"cache-control": "no-cache"},
        on_done=done,
        heartbeat=wire.HEARTBEAT,
        content_type=wire.NDJSON,
    )


async def _download(
    request: Request,
    plan: PullPlan,
    report: Any,
    cancel: threading.Event,
    queue: asyncio.Queue[PullProgress | _Ended],
) -> _Ended:
    """Fetches the plan's files, then has the registry list them; the end goes on the queue."""
    try:
        await asyncio.to_thread(fetch, plan, report, cancel=cancel)
        router = getattr(request.app.state, "router", None)
        if router is not None:
            await asyncio.to_thread(router.registry.scan)
        ended = _Ended(None)
    except PullError as error:
        ended = _Ended(error)
    except PullCancelled as cancelled:
        ended = _Ended(PullError(499, str(cancelled)))
    queue.put_nowait(ended)
    return ended
