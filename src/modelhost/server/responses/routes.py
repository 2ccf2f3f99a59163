"""OpenAI Responses: `POST /v1/responses` (JSON and SSE) and `GET /v1/responses/{id}`.

Wire request → InferenceRequest → the stage → a `response` object, or SSE: `response.created`,
`response.in_progress`, a reasoning item when the model thinks, the message item
(`output_item.added`, `content_part.added`, `output_text.delta`…, `output_text.done`,
`content_part.done`, `output_item.done`), function_call items, then `response.completed` (or
`response.incomplete` when `max_output_tokens` cut the answer, as the API ends it). An
error after the stream opened ends it with `response.failed`.

`previous_response_id` continues a stored conversation: the stored input, its output items and
the new input, in that order (instructions fall back to the stored ones). Answers are stored
unless `store: false`; failed ones never are. The store is the front server's: when a worker
process serves the model, the front names the response (`RESPONSE_ID_HEADER`), hands the
worker the stored turn a request continues (`FORWARDED_TURN_FIELD`) and takes the answer from
the worker's store once it is written (`responses_forwarding`).

The stage splits reasoning and tool calls out of the text; here they become a `reasoning`
item (first) and `function_call` / `custom_tool_call` items (last; tools.py maps the declared
tools both ways, and names the hosted ones nothing here runs). A forced `tool_choice` and
`text.format` (`json_schema`, `json_object`) become the request's grammar; `reasoning.effort`
switches thinking. An answer cut by `max_output_tokens` is `incomplete`, and so are the items
it cut. Codex's `include` (no encrypted reasoning is ever made), `reasoning.summary` and
`prompt_cache_key` (echoed) are accepted.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from modelhost.inference.contracts import (
    ChatPrompt,
    CompletionEvent,
    FinishReason,
    InferenceRequest,
    InferenceResult,
    InvalidRequest,
    Usage,
)
from modelhost.server.exchange import Prepared, Reply, answer_inference
from modelhost.server.http import EventStreamResponse, RequestLog
from modelhost.server.openai import fields
from modelhost.server.responses.store import ResponseStore, StoredResponse
from modelhost.server.responses.tools import ResponsesTools, call_item, read_tools
from modelhost.server.responses.wire import (
    ResponseNotFound,
    message_item,
    output_text,
    reasoning_item,
    responses_error,
    responses_error_json,
    template_messages,
    text_format,
    usage_json,
)
from modelhost.server.sse_frames import named_event
from modelhost.text.tool_calls import ToolCall

if TYPE_CHECKING:
    from modelhost.inference.stage import AdmittedRequest, InferenceStage

ROUTE = "POST /v1/responses"
# From the front to the worker that serves a request: the id to answer under, and the stored
# turn that `previous_response_id` names (only a worker reads them: its socket is the front's).
RESPONSE_ID_HEADER = "x-modelhost-response-id"
FORWARDED_TURN_FIELD = "modelhost_previous_response"


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


async def create_response(request: Request) -> Response | EventStreamResponse:
    store: ResponseStore = request.app.state.response_store
    from_front = request.app.state.settings.owner == "worker"
    named = request.headers.get(RESPONSE_ID_HEADER) if from_front else None
    log = RequestLog(named or new_id("resp"), ROUTE)

    def prepare(body: dict[str, Any]) -> Prepared:
        if from_front:
            forwarded = body.get(FORWARDED_TURN_FIELD)
            prior = StoredResponse.from_json(forwarded) if isinstance(forwarded, dict) else None
            return prepare_turn(body, store, log.request_id, lambda _: prior)
        return prepare_turn(body, store, log.request_id, store.get)

    return await answer_inference(request, log, responses_error, prepare)


def prepare_turn(
    body: dict[str, Any],
    store: ResponseStore,
    request_id: str,
    stored_turn: Callable[[str], StoredResponse | None],
) -> Prepared:
    """The turn `body` asks for (`stored_turn` finds the one it continues); its answer goes to
    `store`."""
    turn = parse_turn(body, stored_turn, request_id)

    def render(result: InferenceResult) -> dict[str, Any]:
        output = output_items(result, turn.tools)
        return turn.complete(store, output, result.finish_reason, result.usage, result.reasoning)

    def reply(stage: InferenceStage, admitted: AdmittedRequest) -> Reply:
        turn.base["model"] = admitted.model_id
        return Reply(render, lambda: ResponseStream(turn, store))

    return Prepared(turn.inference, reply, turn.tools.not_offered)


async def retrieve_response(request: Request) -> Response:
    response_id = request.path_params["response_id"]
    store: ResponseStore = request.app.state.response_store
    stored = await store.get_settled(response_id)
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
    tools: ResponsesTools

    def complete(
        self,
        store: ResponseStore,
        output: list[dict[str, Any]],
        finish_reason: FinishReason,
        usage: Usage,
        reasoning: str = "",
    ) -> dict[str, Any]:
        """The final response object; stored when the request allowed it."""
        response = {**self.base, "status": "completed", "output": output}
        response["usage"] = usage_json(usage, reasoning)
        if finish_reason == "length":
            response["status"] = "incomplete"
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        if self.store:
            entry = StoredResponse(self.items, output, self.instructions, response)
            store.put(self.base["id"], entry)
        return response


def parse_turn(
    body: dict[str, Any],
    stored_turn: Callable[[str], StoredResponse | None],
    request_id: str,
) -> Turn:
    """The turn a body asks for; its response's `model` is set once a model admitted it."""
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
        prior = stored_turn(previous_id)
        if prior is None:
            raise ResponseNotFound(
                f"previous_response_id '{previous_id}' not found or expired",
                param="previous_response_id",
            )
        carried = [item for item in prior.output_items if item.get("type") != "reasoning"]
        items = [*prior.input_items, *carried, *new_items]
        if instructions is None:
            instructions = prior.instructions
    messages, media, images = template_messages(items, instructions)
    tools = read_tools(body)
    max_tokens = fields.number(body, "max_output_tokens", int, at_least=1)
    if max_tokens is None:
        max_tokens = fields.number(body, "max_tokens", int, at_least=1)
    keep = fields.field(body, "store", bool)
    sampling = fields.sampling(body)
    text, grammar, instruction = text_format(body)
    if tools.forced is not None:  # a forced call outranks the text format
        grammar, instruction = tools.forced
    reasoning = fields.field(body, "reasoning", dict)
    effort = (reasoning or {}).get("effort")
    inference = InferenceRequest(
        request_id=request_id,
        method="chat",
        prompt=ChatPrompt(messages=tuple(messages), tools=tools.offered),
        sampling=sampling,
        max_tokens=max_tokens,
        max_tokens_field="max_output_tokens",
        stream=bool(fields.field(body, "stream", bool)),
        thinking=None if effort is None else effort != "none",
        has_media=bool(media),
        media=media,
        images=images,
        structured_output=instruction,
        grammar=grammar,
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
        "model": None,
        "output": [],
        "parallel_tool_calls": fields.field(body, "parallel_tool_calls", bool) is not False,
        "previous_response_id": previous_id,
        "reasoning": reasoning,
        "store": keep is not False,
        "temperature": sampling.temperature,
        "text": text,
        "tool_choice": tools.choice,
        "tools": tools.echo,  # the declared tools the model was offered
        "top_p": sampling.top_p,
        "truncation": "disabled",
        "usage": None,
        "user": None,
        "metadata": fields.field(body, "metadata", dict) or {},
        # Codex's: accepted and echoed; the prefix cache needs no key (it matches by content).
        "prompt_cache_key": fields.field(body, "prompt_cache_key", str),
    }
    return Turn(inference, items, instructions, keep is not False, base, tools)


# ---------------------------------------------------------------------------------------------
# Response


def item_status(finish_reason: FinishReason | None) -> str:
    """A finished item's status: `incomplete` when the output budget cut the answer."""
    return "incomplete" if finish_reason == "length" else "completed"


def output_items(result: InferenceResult, tools: ResponsesTools) -> list[dict[str, Any]]:
    """Reasoning, then the message (when there is text, or nothing else), then the calls."""
    items: list[dict[str, Any]] = []
    status = item_status(result.finish_reason)
    if result.reasoning:
        items.append(reasoning_item(new_id("rs"), result.reasoning, status))
    if result.text or not result.tool_calls:
        items.append(message_item(new_id("msg"), result.text, status))
    for call in result.tool_calls:
        items.append(call_item(_call_id(call), call, "completed", tools.namespaced))
    return items


def _call_id(call: ToolCall) -> str:
    return new_id("ctc" if call.input is not None else "fc")


class ResponseStream:
    """The SSE events of one streamed response: a reasoning item while the model thinks, a
    message item (opened at the first text), then one function_call item per parsed call."""

    def __init__(self, turn: Turn, store: ResponseStore) -> None:
        self.turn = turn
        self.store = store
        self.sequence_number = 0
        self.output: list[dict[str, Any]] = []  # finished items
        self.open: str | None = None  # the open item's type
        self.item_id = ""
        self.text: list[str] = []  # the open item's text so far
        self.reasoning: list[str] = []

    def _event(self, kind: str, payload: Mapping[str, Any]) -> str:
        body = {"sequence_number": self.sequence_number, **payload}
        self.sequence_number += 1
        return named_event(kind, body)

    @property
    def _where(self) -> dict[str, Any]:
        return {"item_id": self.item_id, "output_index": len(self.output)}

    def start(self) -> list[str]:
        base = self.turn.base
        return [
            self._event("response.created", {"response": base}),
            self._event("response.in_progress", {"response": base}),
        ]

    def delta(self, event: CompletionEvent) -> list[str]:
        frames: list[str] = []
        if event.reasoning:
            frames += self._open("reasoning")
            self.text.append(event.reasoning)
            self.reasoning.append(event.reasoning)
            payload = {**self._where, "summary_index": 0, "delta": event.reasoning}
            frames.append(self._event("response.reasoning_summary_text.delta", payload))
        if event.text:
            frames += self._open("message")
            self.text.append(event.text)
            payload = {**self._where, "content_index": 0, "delta": event.text, "logprobs": []}
            frames.append(self._event("response.output_text.delta", payload))
        return frames

    def finish(self, event: CompletionEvent) -> list[str]:
        assert event.usage is not None and event.finish_reason is not None
        frames = self.delta(event)
        if not self.output and self.open is None and not event.tool_calls:
            frames += self._open("message")  # an empty answer is still one message item
        frames += self._close(item_status(event.finish_reason))
        for call in event.tool_calls:
            frames += self._call(call)
        reasoning = "".join(self.reasoning)
        response = self.turn.complete(
            self.store, self.output, event.finish_reason, event.usage, reasoning
        )
        # The API ends a stream its budget cut with `response.incomplete`, not `completed`.
        closing = (
            "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        )
        frames.append(self._event(closing, {"response": response}))
        return frames

    def error(self, status: int, body: Mapping[str, Any]) -> list[str]:
        error = responses_error_json(status, body)["error"]
        output = list(self.output)
        if self.open == "message":
            output.append(message_item(self.item_id, "".join(self.text), "incomplete"))
        response = {
            **self.turn.base,
            "status": "failed",
            "output": output,
            "error": {"code": error.get("code") or error["type"], "message": error["message"]},
        }
        return [self._event("response.failed", {"response": response})]

    def _open(self, kind: str) -> list[str]:
        if self.open == kind:
            return []
        frames = self._close()
        self.open, self.text = kind, []
        if kind == "reasoning":
            self.item_id = new_id("rs")
            item = reasoning_item(self.item_id, None, "in_progress")
            added = {"output_index": len(self.output), "item": item}
            return [*frames, self._event("response.output_item.added", added)]
        self.item_id = new_id("msg")
        item = message_item(self.item_id, None, "in_progress")
        added = {"output_index": len(self.output), "item": item}
        part = {**self._where, "content_index": 0, "part": output_text("")}
        return [
            *frames,
            self._event("response.output_item.added", added),
            self._event("response.content_part.added", part),
        ]

    def _close(self, status: str = "completed") -> list[str]:
        """Close the open item; `status`: `incomplete` when the budget cut it."""
        kind, text = self.open, "".join(self.text)
        self.open = None
        if kind == "reasoning":
            done = {**self._where, "summary_index": 0, "text": text}
            frame = self._event("response.reasoning_summary_text.done", done)
            return [frame, *self._item_done(reasoning_item(self.item_id, text, status))]
        if kind == "message":
            where = {**self._where, "content_index": 0}
            return [
                self._event("response.output_text.done", {**where, "text": text, "logprobs": []}),
                self._event("response.content_part.done", {**where, "part": output_text(text)}),
                *self._item_done(message_item(self.item_id, text, status)),
            ]
        return []

    def _call(self, call: ToolCall) -> list[str]:
        """One call's item, whole: added, its input or arguments in one delta, done."""
        namespaced = self.turn.tools.namespaced
        self.item_id = _call_id(call)
        added = call_item(self.item_id, call, "in_progress", namespaced, streaming=True)
        payload = {"output_index": len(self.output), "item": added}
        frames = [self._event("response.output_item.added", payload)]
        if call.input is not None:
            prefix, key, value = "response.custom_tool_call_input", "input", call.input
        else:
            prefix, key, value = "response.function_call_arguments", "arguments", call.arguments
        frames.append(self._event(f"{prefix}.delta", {**self._where, "delta": value}))
        frames.append(self._event(f"{prefix}.done", {**self._where, key: value}))
        return frames + self._item_done(call_item(self.item_id, call, "completed", namespaced))

    def _item_done(self, item: dict[str, Any]) -> list[str]:
        payload = {"output_index": len(self.output), "item": item}
        self.output.append(item)
        return [self._event("response.output_item.done", payload)]
