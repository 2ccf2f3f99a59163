"""OpenAI Responses wire format: input items → template messages, errors, output items.

Input items are flattened into the OpenAI-chat-style messages every chat template reads:
`message` items by role (leading system and developer messages join `instructions` in one
leading system message; later ones stay in place as system turns), `function_call` and
`custom_tool_call` items become the assistant's `tool_calls` (a namespaced call under its flat
name, tools.py), their `*_output` items become `role: "tool"` messages, and `reasoning` items
are dropped. Image, file, audio and
video parts only record the kinds of media the request carries (`inference.media`: the stage
refuses them with a 400 for a model without the tower, or a 501 it cannot place).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from starlette.responses import JSONResponse, Response

from modelhost.inference.contracts import (
    GrammarSpec,
    ImagePart,
    InvalidRequest,
    RequestError,
    Usage,
    overflow_sizes,
)
from modelhost.server.content_parts import FlatContent, flatten_content, require_role
from modelhost.server.http import ErrorShape
from modelhost.server.openai import fields
from modelhost.server.openai.wire import context_length_exceeded
from modelhost.server.responses.tools import flat_name
from modelhost.server.sse_frames import named_event

ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text")


class ResponseNotFound(RequestError):
    def __init__(self, message: str, param: str | None = None) -> None:
        body = {"message": message, "type": "invalid_request_error", "param": param}
        super().__init__(404, message, {**body, "code": "not_found"})


def responses_error_json(status: int, body: Mapping[str, Any]) -> dict[str, Any]:
    """`{error: {message, type, param, code}}`; the neutral `type` moves to `code` if unset.
    A prompt over the window is OpenAI's `context_length_exceeded` on `input`."""
    sizes = overflow_sizes(body)
    if sizes is not None:
        return {"error": context_length_exceeded(*sizes, param="input")}
    error = dict(body)
    error.setdefault("message", "error")
    if error.get("code") is None and error.get("type") not in (None, "invalid_request_error"):
        error["code"] = error["type"]
    error["type"] = "server_error" if status >= 500 else "invalid_request_error"
    error.setdefault("param", None)
    error.setdefault("code", None)
    return {"error": error}


def responses_error(status: int, body: Mapping[str, Any]) -> Response:
    return JSONResponse(responses_error_json(status, body), status_code=status)


def responses_stream_error(status: int, body: Mapping[str, Any]) -> str:
    """The `error` event the front ends a broken stream with (the stream's own `response.failed`
    needs what the stream sent so far, which only its writer knows)."""
    error = responses_error_json(status, body)["error"]
    return named_event("error", {**error, "type": "error", "param": error.get("param")})


RESPONSES_ERRORS = ErrorShape(responses_error, responses_stream_error)


def template_messages(
    items: Sequence[Mapping[str, Any]], instructions: str | None
) -> tuple[list[dict[str, Any]], frozenset[str], tuple[ImagePart, ...]]:
    """Input items as template messages, the kinds of media they carry, their images in order.

    `instructions` and the system/developer messages before the first other item become one
    leading system message; a later system/developer message stays where it is (as a system
    turn), so the prompt before it, and the prefix cache that holds it, stay the same.
    """
    system = [instructions or ""]
    messages: list[dict[str, Any]] = []
    has_media: frozenset[str] = frozenset()
    images: list[ImagePart] = []
    for index, item in enumerate(items):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise InvalidRequest(f"{where} must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            role = require_role(role, ROLES, where, "input")
            flat = _content(item.get("content"), where)
            has_media = has_media | flat.media
            if role in ("system", "developer"):
                if flat.images:
                    message = f"{where}: images are not accepted in {role} messages"
                    raise InvalidRequest(message, param="input")
                if messages:
                    messages.append({"role": "system", "content": flat.text})
                else:
                    system.append(flat.text)
            else:
                images.extend(flat.images)
                messages.append({"role": role, "content": flat.template_content()})
        elif kind in ("function_call", "custom_tool_call"):
            read = _function_call if kind == "function_call" else _custom_call
            call = read(item, where)
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            text = _output_text(item.get("output"))
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
        elif kind == "reasoning":
            continue  # the reference drops reasoning on the way back in
        else:
            raise InvalidRequest(f"{where} has an unsupported type {kind!r}", param="input")
    instruction = "\n\n".join(text for text in system if text)
    if instruction:
        messages.insert(0, {"role": "system", "content": instruction})
    return messages, has_media, tuple(images)


def _content(content: Any, where: str) -> FlatContent:
    return flatten_content(
        content, where, param="input", text_types=TEXT_PARTS, others={"refusal": _refusal}
    )


def _refusal(part: Mapping[str, Any], where: str) -> str:
    return str(part.get("refusal") or "")


def _output_text(output: Any) -> str:
    """A call's output as text: a string, the text of a list of content parts, or JSON."""
    if isinstance(output, str):
        return output
    if isinstance(output, list) and all(isinstance(part, dict) for part in output):
        texts = [part.get("text") for part in output]
        if all(isinstance(text, str) for text in texts):
            return "".join(str(text) for text in texts)
    return json.dumps(output)


def _call_name(item: Mapping[str, Any], where: str) -> str:
    """The tool name a call item names, flat when it names a namespace (as it was offered)."""
    name = item.get("name")
    if not isinstance(name, str):
        raise InvalidRequest(f"{where}.name must be of type str", param="input")
    namespace = item.get("namespace")
    return flat_name(namespace, name) if isinstance(namespace, str) else name


def _custom_call(item: Mapping[str, Any], where: str) -> dict[str, Any]:
    name = _call_name(item, where)
    text = item.get("input")
    if not isinstance(text, str):
        raise InvalidRequest(f"{where}.input must be of type str", param="input")
    call_id = item.get("call_id") or item.get("id") or ""
    return {"id": call_id, "type": "custom", "custom": {"name": name, "input": text}}


def _function_call(item: Mapping[str, Any], where: str) -> dict[str, Any]:
    name = _call_name(item, where)
    arguments: Any = item.get("arguments") or "{}"
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):  # templates that want text get the text
            arguments = json.loads(arguments)
    call_id = item.get("call_id") or item.get("id") or ""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def text_format(body: dict[str, Any]) -> tuple[dict[str, Any], GrammarSpec | None, str | None]:
    """`text.format` → (the `text` to echo, the grammar to enforce, the fallback instruction)."""
    text = fields.field(body, "text", dict) or {}
    spec = text.get("format") or {"type": "text"}
    kind = spec.get("type") if isinstance(spec, dict) else None
    echo = {**text, "format": spec}
    if kind == "text":
        return echo, None, None
    if kind == "json_object":
        return echo, GrammarSpec("json_object", field="text.format"), fields.JSON_OBJECT_INSTRUCTION
    if kind == "json_schema" and isinstance(spec.get("schema"), dict):
        schema = json.dumps(spec["schema"], ensure_ascii=False)
        enforced = GrammarSpec("json_schema", schema, field="text.format.schema")
        return echo, enforced, fields.json_schema_instruction(schema)
    raise InvalidRequest(
        "text.format must be {type: 'text'}, {type: 'json_object'} or "
        "{type: 'json_schema', schema: {...}}",
        param="text",
    )


def usage_json(usage: Usage, reasoning: str = "") -> dict[str, Any]:
    # The reference counts reasoning tokens as the reasoning's words (at least one when any).
    reasoning_tokens = max(len(reasoning.split()), 1) if reasoning else 0
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {
            "reasoning_tokens": reasoning_tokens,
            **usage.prediction_details(),  # speculation's guesses, named as on chat
        },
        "total_tokens": usage.total_tokens,
    }


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """An assistant message item; `status` is `incomplete` when the budget cut it."""
    content = [] if text is None else [output_text(text)]
    return {
        "id": item_id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": content,
    }


def reasoning_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    summary = [] if text is None else [{"type": "summary_text", "text": text}]
    return {"id": item_id, "type": "reasoning", "status": status, "summary": summary}
