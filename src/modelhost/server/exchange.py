"""A surface handler's skeleton, written once: read the body, parse it, find the stage, admit the
request (or run the work), answer JSON or SSE; any refusal on the way is one `error_response`
in the surface's own shape, and the request log gets exactly one line.

A completion surface supplies `prepare`: its parser, which turns the body into the neutral
request and says how to write the answer once the stage has admitted it (`Reply`). Surfaces
that answer at once (decisions, token counts, embeddings) supply the work that makes the JSON.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from modelhost.inference.contracts import InferenceRequest, InferenceResult
from modelhost.server import tools_not_offered
from modelhost.server.adapter_choice import with_adapter
from modelhost.server.http import (
    EVENT_STREAM,
    HEARTBEAT,
    ErrorFormatter,
    EventStreamResponse,
    RequestLog,
    StreamProtocol,
    error_response,
    read_json_object,
    respond_json,
    respond_stream,
    serving_stage,
)

if TYPE_CHECKING:
    from modelhost.inference.stage import AdmittedRequest, InferenceStage


@dataclass(frozen=True, slots=True)
class Reply:
    """How one admitted request's answer is written: its JSON, or its stream's frames."""

    json: Callable[[InferenceResult], Mapping[str, Any]]
    stream: Callable[[], StreamProtocol]


@dataclass(frozen=True, slots=True)
class Prepared:
    """A parsed body: the neutral request, and its reply once the stage has admitted it."""

    inference: InferenceRequest
    reply: Callable[[InferenceStage, AdmittedRequest], Reply]
    # Tools the request declared that the model was not offered (tools_not_offered.py): named
    # in a response header and the request's log line.
    tools_not_offered: tuple[str, ...] = ()


async def answer_inference(
    request: Request,
    log: RequestLog,
    errors: ErrorFormatter,
    prepare: Callable[[dict[str, Any]], Prepared],
    *,
    heartbeat: str = HEARTBEAT,
    content_type: str = EVENT_STREAM,
) -> Response | EventStreamResponse:
    """Parse, admit and answer one completion request (`heartbeat`: the surface's keep-alive;
    `content_type`: its stream's)."""
    try:
        body = await read_json_object(request)
        prepared = prepare(body)
        stage = serving_stage(request, body.get("model"))
        inference = with_adapter(prepared.inference, body, stage.adapter_names())
        admitted = await stage.admit(inference)
    except Exception as exc:
        return error_response(exc, log.request_id, errors, log)
    log.admitted = admitted
    reply = prepared.reply(stage, admitted)
    if prepared.tools_not_offered:
        log.notes[tools_not_offered.LOG_FIELD] = ",".join(prepared.tools_not_offered)
    headers = tools_not_offered.headers(prepared.tools_not_offered)
    if prepared.inference.stream:
        return respond_stream(
            request,
            admitted,
            reply.stream(),
            log,
            heartbeat=heartbeat,
            content_type=content_type,
            headers=headers,
        )
    return await respond_json(request, admitted, reply.json, errors, log, headers=headers)


async def answer_json(
    request: Request,
    log: RequestLog,
    errors: ErrorFormatter,
    work: Callable[[dict[str, Any]], Awaitable[Mapping[str, Any]]],
) -> Response:
    """The JSON `work` makes of the body, for surfaces that admit nothing to stream."""
    try:
        answer = await work(await read_json_object(request))
    except Exception as exc:
        return error_response(exc, log.request_id, errors, log)
    log.finish(200)
    return JSONResponse(answer)
