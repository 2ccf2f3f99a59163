"""A protocol this server does not speak, added the way any is: this module (its handler and
its wire format) and one `Surface` entry. `POST /v1/echo {model, text}` answers
`{model, echo}` with the text the model generates for `text`; refusals are `{oops: {...}}`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from modelhost.inference.contracts import InferenceRequest, InvalidRequest, TextPrompt
from modelhost.server.http import ErrorShape, read_json_object, serving_stage
from modelhost.server.surfaces import Route, Surface


def echo_error(status: int, body: Mapping[str, Any]) -> Response:
    return JSONResponse({"oops": {"status": status, **body}}, status_code=status)


def echo_stream_error(status: int, body: Mapping[str, Any]) -> str:
    return f"data: oops {status}\n\n"


async def create_echo(request: Request) -> Response:
    try:
        body = await read_json_object(request)
        if not isinstance(body.get("text"), str):
            raise InvalidRequest("text must be of type str", param="text")
        stage = serving_stage(request, body.get("model"))
        inference = InferenceRequest("echo-1", "text", TextPrompt(body["text"]), max_tokens=8)
        result = await (await stage.admit(inference)).run()
    except InvalidRequest as exc:
        return echo_error(exc.status, exc.body)
    return JSONResponse({"model": stage.model_id, "echo": result.text})


SURFACE = Surface(
    "echo",
    (Route("POST", "/v1/echo", create_echo, "generate"),),
    ErrorShape(echo_error, echo_stream_error),
)
