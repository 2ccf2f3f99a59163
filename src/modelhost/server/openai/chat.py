"""OpenAI chat completions: `POST /v1/chat/completions`, JSON and SSE.

Wire request → InferenceRequest (validated with the reference's 400 messages, messages
normalised for the template) → the stage → `chat.completion` JSON, or SSE: a role primer, one
chunk per text delta, a terminal chunk with `finish_reason` (and `usage`), then `[DONE]`.

`stream_options.include_usage: true` gives what OpenAI clients expect: the terminal chunk has no
usage and one more chunk follows with `choices: []` and the usage. Without it the terminal chunk
carries the usage, as the reference server does.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from modelhost.inference.contracts import (
    ChatPrompt,
    CompletionEvent,
    ImagePart,
    InferenceRequest,
    InferenceResult,
    InvalidRequest,
)
from modelhost.server.content_parts import FlatContent, flatten_content, require_role
from modelhost.server.exchange import Prepared, Reply, answer_inference
from modelhost.server.http import EventStreamResponse, RequestLog
from modelhost.server.openai import fields
from modelhost.server.openai.wire import (
    DONE,
    chat_logprobs_json,
    new_id,
    openai_error,
    openai_stream_error,
    sse,
    tool_calls_json,
    usage_json,
)
from modelhost.server.sse_frames import TextFrames

if TYPE_CHECKING:
    from modelhost.inference.stage import AdmittedRequest, InferenceStage

ROUTE = "POST /v1/chat/completions"
ROLES = ("system", "developer", "user", "assistant", "tool", "function")
TEXT_PARTS = ("text", "input_text")
MAX_TOP_LOGPROBS = 11


async def create_chat_completion(request: Request) -> Response | EventStreamResponse:
    log = RequestLog(new_id("chatcmpl"), ROUTE)
    return await answer_inference(
        request, log, openai_error, lambda body: prepare_chat(body, log.request_id)
    )


def prepare_chat(body: dict[str, Any], request_id: str) -> Prepared:
    inference, options = parse_chat_request(body, request_id)

    def reply(stage: InferenceStage, admitted: AdmittedRequest) -> Reply:
        meta = {"id": request_id, "created": int(time.time()), "model": admitted.model_id}
        return Reply(
            lambda result: chat_completion_json(meta, result),
            lambda: ChatStream(meta, options.include_usage, admitted.want_logprobs),
        )

    return Prepared(inference, reply)


# ---------------------------------------------------------------------------------------------
# Request


def parse_chat_request(
    body: dict[str, Any], request_id: str
) -> tuple[InferenceRequest, fields.StreamOptions]:
    messages, media, images = normalize_messages(body.get("messages"))
    tools = fields.field(body, "tools", list)
    if body.get("tool_choice") == "none":
        tools = None
    template_kwargs = dict(fields.field(body, "chat_template_kwargs", dict) or {})
    enable_thinking = template_kwargs.pop("enable_thinking", None)
    if enable_thinking is not None and not isinstance(enable_thinking, bool):
        raise InvalidRequest(
            "chat_template_kwargs.enable_thinking must be of type bool",
            param="chat_template_kwargs",
        )
    effort = fields.reasoning_effort(body)
    if effort is not None:
        template_kwargs["reasoning_effort"] = effort
    thinking = enable_thinking
    if thinking is None and effort is not None:
        thinking = effort != "none"
    options = fields.stream_options(body)
    grammar, structured_output = fields.structured_output(body)
    forced = fields.forced_tool(body.get("tool_choice"), tools)
    if forced is not None:  # a forced call outranks response_format: it is what the client uses
        grammar, structured_output = forced
    inference = InferenceRequest(
        request_id=request_id,
        method="chat",
        prompt=ChatPrompt(
            messages=tuple(messages),
            tools=tuple(tools) if tools else None,
            template_kwargs=template_kwargs,
        ),
        sampling=fields.sampling(body),
        max_tokens=fields.max_tokens(body),
        max_tokens_field=fields.max_tokens_field(body),
        stop=fields.stop(body),
        ignore_eos=bool(fields.field(body, "ignore_eos", bool)),
        logprobs=chat_logprobs(body),
        stream=options.stream,
        thinking=thinking,
        num_choices=fields.choices(body),
        has_media=bool(media),
        media=media,
        images=images,
        structured_output=structured_output,
        grammar=grammar,
    )
    return inference, options


def chat_logprobs(body: dict[str, Any]) -> int | None:
    """`logprobs` (bool) and `top_logprobs` (0..11, -1 unset) → alternatives to report."""
    wanted = fields.field(body, "logprobs", bool)
    top = fields.field(body, "top_logprobs", int)
    if top == -1:
        top = None
    if top is not None and top < 0:
        raise InvalidRequest("top_logprobs must be at least 0", param="top_logprobs")
    if top is not None and top > MAX_TOP_LOGPROBS:
        raise InvalidRequest(
            f"top_logprobs must be at most {MAX_TOP_LOGPROBS}", param="top_logprobs"
        )
    if wanted or (top is not None and top > 0):
        return top or 0
    return None


def normalize_messages(
    raw: Any,
) -> tuple[list[dict[str, Any]], frozenset[str], tuple[ImagePart, ...]]:
    """Messages as the template wants them, the kinds of media they carry, their images.

    `developer` becomes `system`; text-only part arrays become one string; `reasoning` is
    copied to `reasoning_content`; tool-call arguments given as JSON strings are parsed.
    """
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest("messages required", param="messages")
    messages: list[dict[str, Any]] = []
    has_media: frozenset[str] = frozenset()
    images: list[ImagePart] = []
    for index, message in enumerate(raw):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise InvalidRequest(f"{where} must be of type dict", param="messages")
        role = message.get("role")
        if not isinstance(role, str):
            raise InvalidRequest(f"{where}.role must be of type str", param="messages")
        role = require_role(role, ROLES, where, "messages")
        if role != "assistant":  # an assistant's turn may be only tool calls
            _require_content(message, where)
        out = dict(message)
        out["role"] = "system" if role == "developer" else role
        flat = flatten_content(
            message.get("content"), where, param="messages", text_types=TEXT_PARTS
        )
        out["content"] = _content(message.get("content"), flat)
        has_media = has_media | flat.media
        images.extend(flat.images)
        if isinstance(out.get("reasoning"), str) and not isinstance(
            out.get("reasoning_content"), str
        ):
            out["reasoning_content"] = out["reasoning"]
        if isinstance(out.get("tool_calls"), list):
            out["tool_calls"] = [_parsed_arguments(call) for call in out["tool_calls"]]
        messages.append(out)
    return messages, has_media, tuple(images)


def _require_content(message: dict[str, Any], where: str) -> None:
    """OpenAI's 400s for a message without content, naming it (`messages[0].content`)."""
    field = f"{where}.content"
    if "content" not in message:
        missing = f"Missing required parameter: '{field}'."
        raise InvalidRequest(missing, param=field, code="missing_required_parameter")
    if message["content"] is None:
        expected = "expected one of a string or array of objects, but got null instead"
        raise InvalidRequest(f"Invalid type for '{field}': {expected}.", field, "invalid_type")


def _content(content: Any, flat: FlatContent) -> Any:
    """Text parts joined into one string; with images, text and image parts in order (the
    template places them); with other media, the parts as they are (refused later)."""
    if flat.images:
        return flat.template_content()
    return list(content) if flat.media else flat.text


def _parsed_arguments(call: Any) -> Any:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    function = dict(call["function"])
    if isinstance(function.get("arguments"), str):
        with contextlib.suppress(ValueError):
            function["arguments"] = json.loads(function["arguments"])
    return {**call, "function": function}


# ---------------------------------------------------------------------------------------------
# Response


def chat_completion_json(meta: Mapping[str, Any], result: InferenceResult) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": result.text}
    if result.reasoning:
        message["reasoning"] = result.reasoning
    if result.tool_calls:
        message["tool_calls"] = tool_calls_json(result.tool_calls)
        message["content"] = result.text or None  # null only when the answer is just calls
    return {
        **meta,
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": (
                    chat_logprobs_json(result.logprobs) if result.logprobs is not None else None
                ),
                "finish_reason": result.finish_reason,
            }
        ],
        "usage": usage_json(result.usage),
    }


class ChatStream:
    """The `chat.completion.chunk` frames of one streamed answer."""

    def __init__(self, meta: Mapping[str, Any], include_usage: bool, want_logprobs: bool):
        self.meta = {**meta, "object": "chat.completion.chunk"}
        self.include_usage = include_usage
        self.want_logprobs = want_logprobs
        self._content = TextFrames(lambda text: self._chunk({"content": text}, None))
        self._reasoning = TextFrames(lambda text: self._chunk({"reasoning": text}, None))

    def _chunk(
        self, delta: dict[str, Any], finish_reason: str | None, logprobs: Any = None, **extra: Any
    ) -> str:
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return sse({**self.meta, "choices": [choice], **extra})

    def start(self) -> list[str]:
        return [self._chunk({"role": "assistant", "content": ""}, None)]

    def delta(self, event: CompletionEvent) -> list[str]:
        frames = []
        if event.reasoning:
            frames.append(self._reasoning(event.reasoning))
        if not event.text and not event.logprobs:
            return frames
        if self.want_logprobs and event.logprobs:
            logprobs = chat_logprobs_json(event.logprobs)
            frames.append(self._chunk({"content": event.text}, None, logprobs))
        else:
            frames.append(self._content(event.text))
        return frames

    def finish(self, event: CompletionEvent) -> list[str]:
        assert event.usage is not None
        frames = self.delta(event)
        if event.tool_calls:  # all calls in one chunk: they parse only once the text is whole
            calls = tool_calls_json(event.tool_calls, indexed=True)
            frames.append(self._chunk({"tool_calls": calls}, None))
        usage = usage_json(event.usage)
        if self.include_usage:
            frames.append(self._chunk({}, event.finish_reason))
            frames.append(sse({**self.meta, "choices": [], "usage": usage}))
        else:
            frames.append(self._chunk({}, event.finish_reason, usage=usage))
        frames.append(DONE)
        return frames

    def error(self, status: int, body: Mapping[str, Any]) -> list[str]:
        return [openai_stream_error(status, body)]
