"""OpenAI Responses: `POST /v1/responses` (JSON and SSE) and `GET /v1/responses/{id}`.

Wire request → InferenceRequest → the stage → a `response` object, or SSE: `response.created`,
`response.in_progress`, the message item (`output_item.added`, `content_part.added`,
`output_text.delta`…, `output_text.done`, `content_part.done`, `output_item.done`), then
`response.completed`; an error after the stream opened ends it with `response.failed`.

`previous_response_id` continues a stored conversation: the stored input, its output items and
the new input, in that order (instructions fall back to the stored ones). Answers are stored
unless `store: false`; failed ones never are.

Not here yet (issue 3): function tools are rendered into the prompt, but calls are not parsed
into `function_call` items, reasoning is not split into `reasoning` items, and `text.format`
is not enforced.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from modelhost.inference.contracts import (
    ChatPrompt,
    CompletionEvent,
    CompletionUsage,
    FinishReason,
    InferenceRequest,
    InvalidRequest,
)
from modelhost.server import openai_fields as fields
from modelhost.server.http import (
    RequestLog,
    error_response,
    read_json_object,
    respond_json,
    respond_stream,
    serving_stage,
)
from modelhost.server.response_store import ResponseStore, StoredResponse
from modelhost.server.responses_wire import (
    ResponseNotFound,
    function_tools,
    is_function_tool,
    responses_error,
    responses_error_json,
    template_messages,
)

ROUTE = "POST /v1/responses"


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


async def create_response(request: Request) -> Response:
    log = RequestLog(new_id("resp"), ROUTE)
    store: ResponseStore = request.app.state.response_store
    try:
        body = await read_json_object(request)
        stage = serving_stage(request, body.get("model"))
        turn = parse_turn(body, store, log.request_id, stage.model_id)
        admitted = await stage.admit(turn.inference)
    except Exception as exc:
        return error_response(exc, log.request_id, responses_error, log)
    log.admitted = admitted
    if turn.inference.stream:
        heartbeat_s: float = request.app.state.settings.heartbeat_s
        return respond_stream(admitted, ResponseStream(turn, store), log, heartbeat_s=heartbeat_s)

    def render(result: Any) -> dict[str, Any]:
        return turn.complete(store, result.text, result.finish_reason, result.usage)

    return await respond_json(request, admitted, render, responses_error, log)


async def retrieve_response(request: Request) -> Response:
    response_id = request.path_params["response_id"]
    store: ResponseStore = request.app.state.response_store
    stored = store.get(response_id)
    if stored is None:
        error = ResponseNotFound(f"response '{response_id}' not found or expired")
        return responses_error(error.status, error.body)
    return JSONResponse(dict(stored.response))


# ---------------------------------------------------------------------------------------------
# Request


@dataclass(slots=True)
class Turn:
    """One request's conversation so far, and the response fields it echoes."""

    inference: InferenceRequest
    items: list[Mapping[str, Any]]  # the whole input, stored for the next turn
    instructions: str | None
    store: bool
    base: dict[str, Any]  # the response object's fields known before generation

    def complete(
        self,
        store: ResponseStore,
        text: str,
        finish_reason: FinishReason,
        usage: CompletionUsage,
        message_id: str | None = None,
    ) -> dict[str, Any]:
        """The final response object; stored when the request allowed it."""
        item = message_item(message_id or new_id("msg"), text, "completed")
        response = {**self.base, "status": "completed", "output": [item]}
        response["usage"] = usage_json(usage)
        if finish_reason == "length":
            response["status"] = "incomplete"
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        if self.store:
            entry = StoredResponse(self.items, [item], self.instructions, response)
            store.put(self.base["id"], entry)
        return response


def parse_turn(body: dict[str, Any], store: ResponseStore, request_id: str, model: str) -> Turn:
    raw_input = body.get("input")
    if isinstance(raw_input, str):
        new_items: list[Mapping[str, Any]] = [{"role": "user", "content": raw_input}]
    elif isinstance(raw_input, list):
        new_items = list(raw_input)
    else:
        raise InvalidRequest("input must be a string or an array of items", param="input")
    instructions = fields.field(body, "instructions", str)
    previous_id = fields.field(body, "previous_response_id", str)
    items = new_items
    if previous_id is not None:
        prior = store.get(previous_id)
        if prior is None:
            raise ResponseNotFound(
                f"previous_response_id '{previous_id}' not found or expired",
                param="previous_response_id",
            )
        carried = [item for item in prior.output_items if item.get("type") != "reasoning"]
        items = [*prior.input_items, *carried, *new_items]
        if instructions is None:
            instructions = prior.instructions
    messages, has_media = template_messages(items, instructions)
    tools, tool_choice = function_tools(body)
    max_tokens = fields.number(body, "max_output_tokens", int, at_least=1)
    if max_tokens is None:
        max_tokens = fields.number(body, "max_tokens", int, at_least=1)
    keep = fields.field(body, "store", bool)
    sampling = fields.sampling(body)
    inference = InferenceRequest(
        request_id=request_id,
        method="chat",
        prompt=ChatPrompt(messages=tuple(messages), tools=tools),
        sampling=sampling,
        max_tokens=max_tokens,
        stream=bool(fields.field(body, "stream", bool)),
        has_media=has_media,
    )
    base = {
        "id": request_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "error": None,
        "incomplete_details": None,
        "instructions": instructions,
        "max_output_tokens": max_tokens,
        "model": model,
        "output": [],
        "parallel_tool_calls": True,
        "previous_response_id": previous_id,
        "reasoning": None,
        "store": keep is not False,
        "temperature": sampling.temperature,
        "text": {"format": {"type": "text"}},
        "tool_choice": tool_choice,
        "tools": [tool for tool in body.get("tools") or [] if is_function_tool(tool)],
        "top_p": sampling.top_p,
        "truncation": "disabled",
        "usage": None,
        "user": None,
        "metadata": fields.field(body, "metadata", dict) or {},
    }
    return Turn(inference, items, instructions, keep is not False, base)


# ---------------------------------------------------------------------------------------------
# Response


def usage_json(usage: CompletionUsage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.total_tokens,
    }


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [output_text(text)]
    return {
        "id": item_id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": content,
    }


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


class ResponseStream:
    """The SSE events of one streamed response: one message item, opened at the first text."""

    def __init__(self, turn: Turn, store: ResponseStore) -> None:
        self.turn = turn
        self.store = store
        self.item_id = new_id("msg")
        self.sequence_number = 0
        self.text: list[str] = []
        self.item_open = False

    def _event(self, kind: str, payload: Mapping[str, Any]) -> str:
        body = {"type": kind, "sequence_number": self.sequence_number, **payload}
        self.sequence_number += 1
        data = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
        return f"event: {kind}\ndata: {data}\n\n"

    def start(self) -> list[str]:
        base = self.turn.base
        return [
            self._event("response.created", {"response": base}),
            self._event("response.in_progress", {"response": base}),
        ]

    def delta(self, event: CompletionEvent) -> list[str]:
        if not event.text:
            return []
        frames = self._open_item()
        self.text.append(event.text)
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        payload = {**where, "delta": event.text, "logprobs": []}
        frames.append(self._event("response.output_text.delta", payload))
        return frames

    def finish(self, event: CompletionEvent) -> list[str]:
        assert event.usage is not None and event.finish_reason is not None
        frames = self.delta(event)
        frames += self._open_item()  # an empty answer is still one message item
        text = "".join(self.text)
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        response = self.turn.complete(
            self.store, text, event.finish_reason, event.usage, self.item_id
        )
        frames += [
            self._event("response.output_text.done", {**where, "text": text, "logprobs": []}),
            self._event("response.content_part.done", {**where, "part": output_text(text)}),
            self._event(
                "response.output_item.done", {"output_index": 0, "item": response["output"][0]}
            ),
            self._event("response.completed", {"response": response}),
        ]
        return frames

    def error(self, status: int, body: Mapping[str, Any]) -> list[str]:
        error = responses_error_json(status, body)["error"]
        output = [message_item(self.item_id, "".join(self.text), "incomplete")]
        response = {
            **self.turn.base,
            "status": "failed",
            "output": output if self.item_open else [],
            "error": {"code": error.get("code") or error["type"], "message": error["message"]},
        }
        return [self._event("response.failed", {"response": response})]

    def _open_item(self) -> list[str]:
        if self.item_open:
            return []
        self.item_open = True
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        item = message_item(self.item_id, None, "in_progress")
        return [
            self._event("response.output_item.added", {"output_index": 0, "item": item}),
            self._event("response.content_part.added", {**where, "part": output_text("")}),
        ]
