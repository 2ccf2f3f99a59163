"""A conversation with tools, rewritten into Gemma's native tool turns before templating.

Gemma's chat template knows only user and model turns and ignores `tools`. Gemma's function-
calling convention puts the tool declarations in the prompt, has the model write calls as a
```tool_code fence of Python calls, and feeds results back as a ```tool_output fence in a user
turn. This rewrites the neutral messages to that shape: assistant `tool_calls` become tool_code
fences, `role: "tool"` results become tool_output fences (adjacent user-side turns merge so the
roles still alternate), and the declarations join the system text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

INSTRUCTION = (
    "You have access to functions. If you decide to invoke any of the function(s), you MUST put "
    "it in the format of\n```tool_code\nfunction_name(parameter=value)\n```\n"
    "You SHOULD NOT include any other text in the response if you call a function.\n"
)


def tool_code_messages(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
) -> list[dict[str, Any]]:
    """`messages` in Gemma's tool_code / tool_output form, with `tools` declared up front."""
    out: list[dict[str, Any]] = []
    for message in messages:
        role = message.get("role")
        if role == "tool":
            _append(out, "user", f"```tool_output\n{content_text(message.get('content'))}\n```")
        elif role == "assistant" and message.get("tool_calls"):
            calls = "\n".join(_call_line(call) for call in message["tool_calls"])
            text = content_text(message.get("content")).strip()
            fence = f"```tool_code\n{calls}\n```"
            out.append({"role": "assistant", "content": f"{text}\n{fence}" if text else fence})
        elif role == "user":
            _append(out, "user", content_text(message.get("content")))
        else:
            out.append(dict(message))
    if tools:
        declarations = "\n".join(json.dumps(_function(tool), ensure_ascii=False) for tool in tools)
        preamble = f"{INSTRUCTION}\n{declarations}"
        if out and out[0].get("role") == "system":
            system = content_text(out[0].get("content"))
            out[0] = {**out[0], "content": f"{system}\n\n{preamble}".strip()}
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out


def _append(out: list[dict[str, Any]], role: str, text: str) -> None:
    if out and out[-1].get("role") == role and isinstance(out[-1].get("content"), str):
        out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n{text}"}
    else:
        out.append({"role": role, "content": text})


def _call_line(call: Mapping[str, Any]) -> str:
    name, arguments = call_parts(call)
    # repr of JSON values is a Python literal: the same form the model writes and we parse.
    keywords = ", ".join(f"{key}={value!r}" for key, value in arguments.items())
    return f"{name}({keywords})"


def call_parts(call: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """A conversation's tool call (OpenAI's shape or a bare one) as (name, arguments object);
    arguments that are JSON text are parsed, anything not an object counts as none."""
    function = call.get("function", call)
    arguments: Any = function.get("arguments") or {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            arguments = {}
    if not isinstance(arguments, dict):
        arguments = {}
    return str(function.get("name", "")), arguments


def _function(tool: Mapping[str, Any]) -> Any:
    function = tool.get("function", tool)
    return dict(function) if isinstance(function, Mapping) else function


def content_text(content: Any) -> str:
    """A message's content as prompt text: a string, text parts joined by lines, else JSON."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [part.get("text", "") for part in content if isinstance(part, Mapping)]
        if all(isinstance(part, str) for part in parts):
            return "\n".join(parts)
    return json.dumps(content, ensure_ascii=False)
