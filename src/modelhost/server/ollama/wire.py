"""Ollama's wire format: request fields → the neutral request's parts, errors, NDJSON lines.

Errors are `{"error": "..."}` with the status (404 naming an unknown model, 400 for bad input);
a stream that breaks after it opened ends with one such line. Model names are `name:tag`: a
model is found by its modelhost id, with or without `:latest`. `options` map to the sampler
(temperature, top_p, top_k, min_p, num_predict, seed, stop, repeat_penalty, presence and
frequency penalties); runtime options that only tune Ollama's own runner (num_gpu, num_thread,
num_batch, use_mmap, ...) are accepted and ignored; sampler options this server does not have
(mirostat, typical_p, tfs_z) are refused unless set to their neutral values. `logprobs` and
`top_logprobs` come back as Ollama's `logprobs` list on the reply (on each streamed line, for its
tokens).
"""

from __future__ import annotations

import json
import math
import re
import uuid
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from starlette.responses import JSONResponse, Response

from modelhost.inference.contracts import (
    GrammarSpec,
    ImagePart,
    InvalidRequest,
    RequestError,
    SamplingRequest,
    overflow_sizes,
)
from modelhost.server.content_parts import flatten_content, require_role
from modelhost.server.http import ErrorShape
from modelhost.server.openai import fields

NDJSON = "application/x-ndjson"
# A stream's keep-alive: a space, which the next line's JSON reads as leading whitespace (a
# blank line would be an empty JSON document to the clients' line readers).
HEARTBEAT = " "
LATEST = ":latest"
ROLES = ("system", "user", "assistant", "tool")
PINNED_UNTIL = datetime(9999, 12, 31, 23, 59, 59, tzinfo=UTC)  # what `/api/ps` says of a pin
# Options of Ollama's own runner (hardware, batching, memory): nothing to map, nothing changed.
RUNNER_OPTIONS = frozenset(
    (
        "num_gpu", "main_gpu", "num_thread", "num_batch", "use_mmap", "use_mlock", "low_vram",
        "numa", "f16_kv", "vocab_only", "num_keep", "repeat_last_n", "penalize_newline",
    )
)  # fmt: skip
# Sampler options this server does not have, and the value at which each changes nothing.
NEUTRAL_OPTIONS = {"mirostat": 0, "typical_p": 1.0, "tfs_z": 1.0}
MAX_TOP_LOGPROBS = 20
LOGPROB_FLOOR = -9999.0  # JSON has no -inf


def new_id() -> str:
    return f"ollama-{uuid.uuid4().hex[:24]}"


def created_at(at: datetime | None = None) -> str:
    """RFC 3339 in UTC, as Ollama writes its timestamps."""
    return (at or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def line(payload: Mapping[str, Any]) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")) + "\n"


# ---------------------------------------------------------------------------------------------
# Errors


def ollama_error(status: int, body: Mapping[str, Any]) -> Response:
    return JSONResponse({"error": error_message(body)}, status_code=status)


def ollama_stream_error(status: int, body: Mapping[str, Any]) -> str:
    return line({"error": error_message(body)})


def error_message(body: Mapping[str, Any]) -> str:
    """The `error` string: the neutral message, or a prompt over the window in Ollama's words
    (what it answers a request with `truncate: false`), with both sizes."""
    sizes = overflow_sizes(body)
    if sizes is not None:
        prompt_tokens, limit = sizes
        return (
            f"the input length exceeds the context length: the prompt is {prompt_tokens} "
            f"tokens and the context length is {limit}"
        )
    return str(body.get("message") or "error")


OLLAMA_ERRORS = ErrorShape(ollama_error, ollama_stream_error)


def model_not_found(name: str) -> RequestError:
    message = f"model '{name}' not found"
    body = {"message": message, "type": "not_found_error", "code": "model_not_found"}
    return RequestError(404, message, {**body, "param": "model"})


def local_id(named: Any, known: Callable[[str], bool]) -> str:
    """The local model an Ollama name means: the id itself, or the id with `:latest`. A missing
    name is a 400; a name no local model answers to is a 404 naming it."""
    if named is None or named == "":
        raise InvalidRequest("model is required", param="model")
    if not isinstance(named, str):
        raise InvalidRequest("model must be a string", param="model")
    if known(named):
        return named
    if named.endswith(LATEST) and known(named.removesuffix(LATEST)):
        return named.removesuffix(LATEST)
    raise model_not_found(named)


def listed_name(model_id: str) -> str:
    """How `/api/tags` names a model: Ollama's `name:tag`, the tag `latest` unless it has one."""
    return model_id if ":" in model_id.rsplit("/", 1)[-1] else model_id + LATEST


# ---------------------------------------------------------------------------------------------
# keep_alive

_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
FOREVER_S = 100 * 365 * 86400.0
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def keep_alive(body: Mapping[str, Any]) -> float | None:
    """`keep_alive` in seconds: a number (seconds) or a Go duration ("5m", "1h30m", "-1");
    below 0 pins the model, 0 lets it go after this response. None: not given."""
    value = body.get("keep_alive")
    if value is None:
        return None
    message = 'keep_alive must be a duration ("5m", "1h", "0", "-1") or a number of seconds'
    if isinstance(value, bool):
        raise InvalidRequest(message, param="keep_alive")
    if isinstance(value, int | float):
        return _seconds(float(value), message)
    if not isinstance(value, str):
        raise InvalidRequest(message, param="keep_alive")
    text = value.strip()
    sign = -1.0 if text.startswith("-") else 1.0
    text = text.lstrip("+-")
    try:
        return _seconds(sign * float(text), message)  # a bare number is seconds
    except ValueError:
        pass
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise InvalidRequest(message, param="keep_alive")
    return _seconds(sign * sum(float(n) * _UNIT_S[unit] for n, unit in parts), message)


def _seconds(seconds: float, message: str) -> float:
    """A keep-alive as the host takes it: a hold longer than a century is a pin."""
    if math.isnan(seconds):
        raise InvalidRequest(message, param="keep_alive")
    return -1.0 if seconds >= FOREVER_S else seconds


def keep_alive_of(body: bytes) -> float | None:
    """The keep-alive a buffered body asks for; None when it asks none or the body is bad
    (its handler then answers the 400)."""
    try:
        value = json.loads(body)
        return keep_alive(value) if isinstance(value, dict) else None
    except (ValueError, UnicodeDecodeError, RequestError):
        return None


# ---------------------------------------------------------------------------------------------
# options, format, think


def options(body: Mapping[str, Any]) -> dict[str, Any]:
    value = body.get("options")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidRequest("options must be an object", param="options")
    for name, neutral in NEUTRAL_OPTIONS.items():
        if value.get(name) is not None and value[name] != neutral:
            raise InvalidRequest(f"options.{name} is not supported by this server", "options")
    return value


def sampling(opts: dict[str, Any]) -> SamplingRequest:
    top_k = fields.number(opts, "top_k", int, at_least=0)
    return SamplingRequest(
        temperature=fields.number(opts, "temperature", at_least=0),
        top_p=fields.number(opts, "top_p", at_least=0, at_most=1),
        top_k=top_k or None,  # 0: off, as Ollama's runner reads it
        min_p=fields.number(opts, "min_p", at_least=0, at_most=1),
        repetition_penalty=fields.number(opts, "repeat_penalty", above=0),
        presence_penalty=fields.number(opts, "presence_penalty", at_least=-2, at_most=2),
        frequency_penalty=fields.number(opts, "frequency_penalty", at_least=-2, at_most=2),
        seed=fields.field(opts, "seed", int),
    )


def max_tokens(opts: dict[str, Any]) -> int | None:
    """`num_predict`: a count; -1 (no limit) and -2 (fill the context) leave it to the
    server's default and the context the model holds."""
    value = fields.number(opts, "num_predict", int, at_least=-2)
    return value if value is not None and value > 0 else None


def num_ctx(opts: dict[str, Any]) -> int | None:
    """Validated only: a request's context is what the model holds under the memory
    admission, never more than its window."""
    value: int | None = fields.number(opts, "num_ctx", int, at_least=1)
    return value


def stop(opts: dict[str, Any]) -> tuple[str, ...]:
    return fields.stop(opts)


def logprobs(body: Mapping[str, Any]) -> int | None:
    """`logprobs` (true: each answer token's log probability) and `top_logprobs` (0..20: that
    many alternatives beside it); None: off."""
    wanted = fields.field(dict(body), "logprobs", bool)
    top = fields.number(dict(body), "top_logprobs", int, at_least=0, at_most=MAX_TOP_LOGPROBS)
    if not wanted and not top:
        return None
    return int(top or 0)


def logprobs_json(tokens: Any) -> list[dict[str, Any]]:
    """The engine's token log probabilities as Ollama writes them: token, logprob, bytes and
    `top_logprobs` of the same shape."""

    def one(token: str, logprob: float) -> dict[str, Any]:
        finite = logprob if math.isfinite(logprob) else LOGPROB_FLOOR
        return {"token": token, "logprob": finite, "bytes": list(token.encode("utf-8"))}

    return [
        {**one(lp.token, lp.logprob), "top_logprobs": [one(t.token, t.logprob) for t in lp.top]}
        for lp in tokens
    ]


def output_format(body: Mapping[str, Any]) -> tuple[GrammarSpec | None, str | None]:
    """`format`: "json" (any JSON object) or a JSON schema, through the same grammar as every
    surface's structured output."""
    value = body.get("format")
    if value is None or value == "":
        return None, None
    if value == "json":
        return GrammarSpec("json_object", field="format"), fields.JSON_OBJECT_INSTRUCTION
    if isinstance(value, dict):
        text = json.dumps(value, ensure_ascii=False)
        return GrammarSpec("json_schema", text, field="format"), fields.json_schema_instruction(
            text
        )
    raise InvalidRequest('format must be "json" or a JSON schema object', param="format")


def think(body: Mapping[str, Any]) -> tuple[bool | None, dict[str, Any]]:
    """`think`: true/false, or an effort ("low", "medium", "high"); the template's switch and
    its keyword arguments."""
    value = body.get("think")
    if value is None or isinstance(value, bool):
        return value, {}
    if value in ("low", "medium", "high"):
        return True, {"reasoning_effort": value}
    raise InvalidRequest('think must be true, false, "low", "medium" or "high"', param="think")


def images(value: Any, where: str) -> list[str]:
    """A message's or a prompt's `images`: base64 strings."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise InvalidRequest(f"{where} must be a list of base64 strings", param="images")
    return value


def image_parts(pictures: list[str], where: str) -> tuple[ImagePart, ...]:
    """A message's or a prompt's images, each named by its place (`messages[0].images[1]`)."""
    return tuple(
        ImagePart(f"{where}[{i}]", picture, "images") for i, picture in enumerate(pictures)
    )


def with_images(text: str, pictures: list[str]) -> Any:
    """Content the template places: the text alone, or image parts then the text (Ollama
    shows a message's images before its text)."""
    if not pictures:
        return text
    parts: list[dict[str, Any]] = [{"type": "image"} for _ in pictures]
    return [*parts, {"type": "text", "text": text}]


# ---------------------------------------------------------------------------------------------
# messages and tools


def tools(body: Mapping[str, Any]) -> tuple[dict[str, Any], ...] | None:
    value = body.get("tools")
    if value is None or value == []:
        return None
    if not isinstance(value, list) or not all(
        isinstance(t, dict) and isinstance(t.get("function"), dict) for t in value
    ):
        message = 'tools must be a list of {"type": "function", "function": {...}} objects'
        raise InvalidRequest(message, param="tools")
    return tuple({"type": "function", **tool} for tool in value)


def template_messages(
    raw: Any,
) -> tuple[list[dict[str, Any]], frozenset[str], tuple[ImagePart, ...]]:
    """Ollama's messages as template messages, the kinds of media they carry, their images."""
    if not isinstance(raw, list):
        raise InvalidRequest("messages must be a list", param="messages")
    out: list[dict[str, Any]] = []
    media: set[str] = set()
    shown: list[ImagePart] = []
    for index, message in enumerate(raw):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise InvalidRequest(f"{where} must be an object", param="messages")
        role = message.get("role")
        role = require_role(role, ROLES, where, "messages")
        text = flatten_content(message.get("content") or "", where, param="messages").text
        pictures = images(message.get("images"), f"{where}.images")
        if pictures:
            media.add("image")
            shown.extend(image_parts(pictures, f"{where}.images"))
        item: dict[str, Any] = {"role": role, "content": with_images(text, pictures)}
        if isinstance(message.get("thinking"), str) and message["thinking"]:
            item["reasoning_content"] = message["thinking"]
        if message.get("tool_calls"):
            item["tool_calls"] = _tool_calls(message["tool_calls"], where)
        name = message.get("tool_name") or message.get("name")
        if role == "tool" and isinstance(name, str):
            item["name"] = name
        out.append(item)
    return out, frozenset(media), tuple(shown)


def _tool_calls(raw: Any, where: str) -> list[dict[str, Any]]:
    message = f"{where}.tool_calls must be a list of {{function: {{name, arguments}}}} objects"
    if not isinstance(raw, list):
        raise InvalidRequest(message, param="messages")
    calls = []
    for call in raw:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidRequest(message, param="messages")
        arguments = function.get("arguments") or {}
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                raise InvalidRequest(message, param="messages") from None
        if not isinstance(arguments, dict):
            raise InvalidRequest(f"{where}.tool_calls: arguments must be an object", "messages")
        call_id = call.get("id") if isinstance(call.get("id"), str) else ""
        named = {"name": function["name"], "arguments": arguments}
        calls.append({"id": call_id, "type": "function", "function": named})
    return calls


def tool_calls_json(calls: Any) -> list[dict[str, Any]]:
    """Parsed calls as Ollama returns them: arguments as an object, not JSON text."""
    return [
        {
            "id": call.id,
            "function": {"index": i, "name": call.name, "arguments": call.arguments_object()},
        }
        for i, call in enumerate(calls)
    ]
