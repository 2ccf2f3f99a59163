"""Anthropic Messages wire format: request fields → template messages, errors, SSE frames.

Content blocks are flattened into the OpenAI-style messages every chat template reads: text
joins into `content`, `thinking` becomes the assistant's `reasoning_content`, `tool_use` becomes
assistant `tool_calls`, and each `tool_result` becomes a `role: "tool"` message. Image and
document blocks record the kinds of media the request carries (`inference.media`: the stage
refuses them with a 400 for a model without the tower, or a 501 it cannot place); image blocks
are kept in order, where the template places them (`content_parts`).
`cache_control` (the prefix cache needs no markers: it matches by content), `metadata`,
`context_management`, `output_config.effort` and unknown fields are accepted and ignored.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any

from starlette.responses import JSONResponse, Response

from modelhost.inference.contracts import GrammarSpec, ImagePart, InvalidRequest, overflow_sizes
from modelhost.server.content_parts import (
    FlatContent,
    PartHandler,
    flatten_content,
    part_text,
    require_role,
)
from modelhost.server.http import ErrorShape
from modelhost.server.openai import fields
from modelhost.server.sse_frames import named_event

ROLES = ("user", "assistant", "system")
BILLING_HEADER = "x-anthropic-billing-header:"  # Claude Code's attribution line, in `system`
BLOCKS = "content blocks"  # what errors call a message's parts
PING = 'event: ping\ndata: {"type":"ping"}\n\n'
_ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


# ---------------------------------------------------------------------------------------------
# Errors


def anthropic_error_json(status: int, body: Mapping[str, Any]) -> dict[str, Any]:
    """`{type: "error", error: {type, message, ...}}`; the neutral `type` moves to `code`, and
    null fields are left out (Anthropic's own errors carry only type and message). A prompt
    over the window is worded as Anthropic's API words it: Claude Code compacts its history
    when the message starts "prompt is too long"."""
    sizes = overflow_sizes(body)
    if sizes is not None:
        prompt_tokens, limit = sizes
        message = f"prompt is too long: {prompt_tokens} tokens > {limit} maximum"
        return {"type": "error", "error": {"type": "invalid_request_error", "message": message}}
    error = {key: value for key, value in body.items() if value is not None}
    error.setdefault("message", "error")
    if error.get("code") is None and error.get("type") not in (None, "invalid_request_error"):
        error["code"] = error["type"]
    default = "api_error" if status >= 500 else "invalid_request_error"
    error["type"] = _ERROR_TYPES.get(status, default)
    return {"type": "error", "error": error}


def anthropic_error(status: int, body: Mapping[str, Any]) -> Response:
    return JSONResponse(anthropic_error_json(status, body), status_code=status)


def anthropic_stream_error(status: int, body: Mapping[str, Any]) -> str:
    """The `error` event that ends a broken stream."""
    return named_event("error", {"error": anthropic_error_json(status, body)["error"]})


ANTHROPIC_ERRORS = ErrorShape(anthropic_error, anthropic_stream_error)


# ---------------------------------------------------------------------------------------------
# Request fields


def stop_sequences(body: dict[str, Any]) -> tuple[str, ...]:
    value = body.get("stop_sequences")
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise InvalidRequest("stop_sequences must be a list of strings", param="stop_sequences")
    return tuple(item for item in value if item)


def thinking(body: dict[str, Any]) -> bool | None:
    """`thinking: {type: enabled|disabled}` → the template's thinking switch (None: its default)."""
    value = fields.field(body, "thinking", dict)
    if value is None:
        return None
    kind = value.get("type")
    if kind not in ("enabled", "disabled", "adaptive"):
        raise InvalidRequest(
            "thinking.type must be one of 'enabled', 'disabled', 'adaptive'", param="thinking"
        )
    return kind != "disabled"


def output_format(body: dict[str, Any]) -> tuple[GrammarSpec | None, str | None]:
    """`output_config.format` (`{type: "json_schema", schema}`) as a grammar and the instruction
    used when no grammar engine enforces it."""
    config = fields.field(body, "output_config", dict) or {}
    spec = config.get("format")
    if spec is None:
        return None, None
    if not isinstance(spec, dict) or spec.get("type") != "json_schema":
        raise InvalidRequest("output_config.format.type must be 'json_schema'", "output_config")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise InvalidRequest("output_config.format.schema must be an object", "output_config")
    text = json.dumps(schema, ensure_ascii=False)
    grammar = GrammarSpec("json_schema", text, field="output_config.format.schema")
    return grammar, fields.json_schema_instruction(text)


def system_text(value: Any, where: str = "system") -> str:
    """`system` as one string: a string, or the text of a list of text blocks."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise InvalidRequest(f"{where} must be a string or a list of text blocks", param="system")
    texts = []
    for number, block in enumerate(value):
        if not isinstance(block, dict) or block.get("type") != "text":
            raise InvalidRequest(f"{where}[{number}] must be a text block", param="system")
        texts.append(part_text(block, f"{where}[{number}]", "messages"))
    return "\n\n".join(texts)


def template_messages(
    body: dict[str, Any],
) -> tuple[list[dict[str, Any]], frozenset[str], tuple[ImagePart, ...]]:
    """The conversation as template messages, the kinds of media its blocks carry, and its
    images in the order the messages show them.

    The top-level `system` and the system-role messages before any other message become one
    leading system message. A system-role message later in the conversation (Claude Code
    sends reminders so) stays where it is, as a system turn: hoisted to the front it would
    change the prompt's start, and every cached prefix with it, on each turn.
    """
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest("messages: at least one message is required", param="messages")
    system = [without_billing_header(system_text(body.get("system")))]
    messages: list[dict[str, Any]] = []
    has_media: frozenset[str] = frozenset()
    images: list[ImagePart] = []
    for index, message in enumerate(raw):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise InvalidRequest(f"{where} must be an object", param="messages")
        role = message.get("role")
        role = require_role(role, ROLES, where, "messages")
        if role == "system":
            text = system_text(message.get("content"), f"{where}.content")
            if messages:
                messages.append({"role": "system", "content": text})
            else:
                system.append(text)
            continue
        flat, media, shown = _flatten(role, message.get("content"), where)
        messages.extend(flat)
        has_media = has_media | media
        images.extend(shown)
    instruction = "\n\n".join(text for text in system if text)
    if instruction:
        messages.insert(0, {"role": "system", "content": instruction})
    return messages, has_media, tuple(images)


def without_billing_header(text: str) -> str:
    """`text` without Claude Code's attribution line (`x-anthropic-billing-header: cc_version=…;
    cch=…`): billing metadata, not instructions, and its checksum changes on every request, so
    left in it would end the cached prefix at the system prompt's first line."""
    if BILLING_HEADER not in text:
        return text
    lines = text.split("\n")
    kept = [line for line in lines if not line.lstrip().startswith(BILLING_HEADER)]
    return "\n".join(kept).strip("\n")


def _flatten(
    role: str, content: Any, where: str
) -> tuple[list[dict[str, Any]], frozenset[str], list[ImagePart]]:
    """One wire message → tool messages (for tool_result blocks) then the message itself; and
    the images they show, in that order."""
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    result_media: set[str] = set()
    images: list[ImagePart] = []

    def thinking(block: Mapping[str, Any], at: str) -> None:
        reasoning.append(str(block.get("thinking") or ""))

    def tool_use(block: Mapping[str, Any], at: str) -> None:
        calls.append(_tool_call(block, at))

    def tool_result(block: Mapping[str, Any], at: str) -> None:
        result, flat = _tool_result(block, at)
        results.append(result)
        result_media.update(flat.media)
        images.extend(flat.images)

    others: dict[str, PartHandler] = {
        "thinking": thinking,
        "redacted_thinking": lambda block, at: None,  # opaque to us: nothing a template shows
        "tool_use": tool_use,
        "tool_result": tool_result,
    }
    flat = flatten_content(
        content, where, param="messages", others=others, noun=BLOCKS, absent_is_empty=False
    )
    out: list[dict[str, Any]] = list(results)
    images.extend(flat.images)
    if flat.texts or flat.images or calls or reasoning or not results:
        message: dict[str, Any] = {"role": role, "content": flat.template_content()}
        if calls:
            message["tool_calls"] = calls
        if reasoning:
            message["reasoning_content"] = "\n".join(reasoning)
        out.append(message)
    return out, flat.media | result_media, images


def _tool_call(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    name = block.get("name")
    if not isinstance(name, str):
        raise InvalidRequest(f"{where}.name must be of type str", param="messages")
    arguments = block.get("input")
    if not isinstance(arguments, dict):
        raise InvalidRequest(f"{where}.input must be an object", param="messages")
    call_id = block.get("id") if isinstance(block.get("id"), str) else ""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _tool_result(block: Mapping[str, Any], where: str) -> tuple[dict[str, Any], FlatContent]:
    flat = flatten_content(block.get("content"), where, param="messages", noun=BLOCKS)
    content = flat.template_content()
    if block.get("is_error") is True:
        content = f"Error: {flat.text}" if isinstance(content, str) else content
    call_id = block.get("tool_use_id") if isinstance(block.get("tool_use_id"), str) else ""
    return {"role": "tool", "tool_call_id": call_id, "content": content}, flat
