"""OpenAI wire pieces both completion surfaces share: ids, usage, logprobs, errors, SSE frames."""

from __future__ import annotations

import math
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from starlette.responses import JSONResponse, Response

from modelhost.inference.contracts import TokenLogprob, Usage, overflow_sizes
from modelhost.server.http import ErrorShape
from modelhost.server.sse_frames import compact_json
from modelhost.text.tool_calls import ToolCall

DONE = "data: [DONE]\n\n"
_LOGPROB_FLOOR = -9999.0  # JSON has no -inf


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(payload: Mapping[str, Any]) -> str:
    return f"data: {compact_json(payload)}\n\n"


def usage_json(usage: Usage) -> dict[str, Any]:
    """The terminal usage block: OpenAI's fields plus `lane` (one request is a batch of one);
    where speculation guessed for the answer, its counts in `completion_tokens_details`."""
    out = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "lane": "batched",
    }
    predictions = usage.prediction_details()
    if predictions:
        out["completion_tokens_details"] = predictions
    return out


def openai_error_json(
    status: int, body: Mapping[str, Any], prompt_param: str = "messages"
) -> dict[str, Any]:
    """`{error: {message, type, code, param, ...}}` from a neutral error body; a prompt over
    the window in OpenAI's own words (`prompt_param` names the request's prompt field), which
    agents match on to compact their history."""
    sizes = overflow_sizes(body)
    if sizes is not None:
        return {"error": context_length_exceeded(*sizes, param=prompt_param)}
    error = dict(body)
    error.setdefault("message", "error")
    if not error.get("type"):
        error["type"] = "server_error" if status >= 500 else "invalid_request_error"
    error.setdefault("code", None)
    error.setdefault("param", None)
    return {"error": error}


def context_length_exceeded(prompt_tokens: int, limit: int, *, param: str) -> dict[str, Any]:
    """OpenAI's `context_length_exceeded` error object; `param` is the prompt's field
    (messages, prompt, input), and the message speaks of it."""
    message = (
        f"This model's maximum context length is {limit} tokens. However, your {param} "
        f"resulted in {prompt_tokens} tokens. Please reduce the length of the {param}."
    )
    return {
        "message": message,
        "type": "invalid_request_error",
        "param": param,
        "code": "context_length_exceeded",
    }


def openai_error(status: int, body: Mapping[str, Any]) -> Response:
    return JSONResponse(openai_error_json(status, body), status_code=status)


def openai_stream_error(status: int, body: Mapping[str, Any]) -> str:
    """The frame that ends a broken stream: `data: {error: {...}}`."""
    return sse(openai_error_json(status, body))


def completion_error(status: int, body: Mapping[str, Any]) -> Response:
    """Legacy completions' errors: OpenAI's, with the prompt in `prompt`."""
    return JSONResponse(openai_error_json(status, body, "prompt"), status_code=status)


def completion_stream_error(status: int, body: Mapping[str, Any]) -> str:
    return sse(openai_error_json(status, body, "prompt"))


OPENAI_ERRORS = ErrorShape(openai_error, openai_stream_error)
COMPLETION_ERRORS = ErrorShape(completion_error, completion_stream_error)


def _finite(value: float) -> float:
    return value if math.isfinite(value) else _LOGPROB_FLOOR


def chat_logprobs_json(logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
    """Chat's `{content: [{id, token, logprob, bytes, top_logprobs: [...]}]}`."""
    return {
        "content": [
            {
                "id": lp.token_id,
                "token": lp.token,
                "logprob": _finite(lp.logprob),
                "bytes": list(lp.token.encode("utf-8")),
                "top_logprobs": [
                    {
                        "id": top.token_id,
                        "token": top.token,
                        "logprob": _finite(top.logprob),
                        "bytes": list(top.token.encode("utf-8")),
                    }
                    for top in lp.top
                ],
            }
            for lp in logprobs
        ]
    }


def text_logprobs_json(logprobs: Sequence[TokenLogprob], text_offset: int = 0) -> dict[str, Any]:
    """Legacy completions' `{tokens, token_logprobs, top_logprobs, text_offset}`."""
    offsets: list[int] = []
    for lp in logprobs:
        offsets.append(text_offset)
        text_offset += len(lp.token)
    return {
        "tokens": [lp.token for lp in logprobs],
        "token_logprobs": [_finite(lp.logprob) for lp in logprobs],
        "top_logprobs": [{top.token: _finite(top.logprob) for top in lp.top} for lp in logprobs],
        "text_offset": offsets,
    }


def tool_calls_json(calls: Sequence[ToolCall], *, indexed: bool = False) -> list[dict[str, Any]]:
    """Chat's `tool_calls` entries (streamed deltas carry each call's `index` too)."""
    out: list[dict[str, Any]] = []
    for index, call in enumerate(calls):
        entry: dict[str, Any] = {"index": index} if indexed else {}
        entry["id"] = call.id
        if call.input is not None:  # a custom (freeform) tool: its raw input
            entry.update({"type": "custom", "custom": {"name": call.name, "input": call.input}})
        else:
            entry.update(
                {"type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            )
        out.append(entry)
    return out
