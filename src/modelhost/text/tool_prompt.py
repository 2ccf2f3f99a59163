"""The built-in tool prompt: tools for a model whose chat template cannot render them.

SmolLM2's and many fine-tunes' templates print only the turns and ignore `tools`, so the
declarations would never reach the model. For those the conversation is rewritten before
templating into one documented format (docs/engine.md, "Tools every model sees"):

- the system message gains a tool section: each tool as one JSON line (name, description and
  the JSON schema of its arguments, or the freeform format of a `custom` tool), and the exact
  shape of a call;
- a function call is written `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  a freeform (custom) tool's call `<tool_input name="...">\\nRAW INPUT</tool_input>` (the input
  verbatim: it ends with its own newline, if it has one); earlier
  assistant calls in the conversation are written back in that shape, so the model reads its
  own calls as it would write them;
- tool results come back as user turns of `<tool_response>` blocks (every template renders a
  user turn; not every one renders a `tool` role).

The tool-call parser reads both call shapes for every family (text/tool_calls.py), and a
request left to choose is held to each tool's schema once a call starts
(inference/grammars/tool_choice.py).

Templates that do render tools keep their own format; a `custom` tool reaches them as a function
of one string argument, `input` (`custom_as_function`), which the output split maps back.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from modelhost.text.tool_code import call_parts, content_text

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
INPUT_OPEN = '<tool_input name="'  # then the tool's name, `">` and a newline
INPUT_CLOSE = "</tool_input>"
RESPONSE_OPEN = "<tool_response>"
RESPONSE_CLOSE = "</tool_response>"

_HEADER = (
    "# Tools\n\n"
    "You can call tools to help with the request. Call one only when it helps; otherwise "
    "answer in plain text. The tools, one JSON object each:\n"
)
_FUNCTION_SHAPE = (
    "To call a function, write exactly this and nothing after it, one block per call:\n"
    f'{CALL_OPEN}\n{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}\n'
    f"{CALL_CLOSE}\n"
)
_FREEFORM_SHAPE = (
    'A tool whose "input" is "freeform" takes raw text in its own format, not JSON. Write the '
    "input verbatim on the lines after the opening tag, its last line ending with a newline:\n"
    f'{INPUT_OPEN}<tool name>">\n<the raw input>\n{INPUT_CLOSE}\n'
)
_RESULTS = f"Results come back in {RESPONSE_OPEN} blocks."


def is_custom(tool: Mapping[str, Any]) -> bool:
    """A freeform tool (Responses' `custom`): raw text in, no JSON arguments."""
    return tool.get("type") == "custom" and isinstance(tool.get("custom"), Mapping)


def tool_name(tool: Mapping[str, Any]) -> str | None:
    spec = tool.get("custom") if is_custom(tool) else tool.get("function", tool)
    name = spec.get("name") if isinstance(spec, Mapping) else None
    return name if isinstance(name, str) else None


def custom_names(tools: Sequence[Mapping[str, Any]] | None) -> frozenset[str]:
    return frozenset(n for tool in tools or () if is_custom(tool) and (n := tool_name(tool)))


def tool_section(tools: Sequence[Mapping[str, Any]]) -> str:
    """The system text that declares `tools` and the shape of a call."""
    lines = [json.dumps(_declaration(tool), ensure_ascii=False) for tool in tools]
    freeform = any(is_custom(tool) for tool in tools)
    functions = any(not is_custom(tool) for tool in tools)
    shapes = (_FUNCTION_SHAPE if functions else "") + (_FREEFORM_SHAPE if freeform else "")
    return f"{_HEADER}<tools>\n" + "\n".join(lines) + f"\n</tools>\n\n{shapes}{_RESULTS}"


def builtin_tool_messages(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
) -> list[Mapping[str, Any]]:
    """`messages` with the tool section in the leading system message, earlier calls written in
    the built-in shape and tool results as user turns."""
    out: list[Mapping[str, Any]] = []
    for message in messages:
        role = message.get("role")
        if role == "tool":
            block = f"{RESPONSE_OPEN}\n{content_text(message.get('content'))}\n{RESPONSE_CLOSE}"
            previous = out[-1] if out else None
            if previous is not None and previous.get("tool_results"):
                out[-1] = {**previous, "content": f"{previous['content']}\n{block}"}
            else:  # `tool_results` marks a turn made of results, for the next one to join
                out.append({"role": "user", "content": block, "tool_results": True})
        elif role == "assistant" and message.get("tool_calls"):
            calls = "\n".join(call_text(call) for call in message["tool_calls"])
            text = content_text(message.get("content")).strip()
            rest = {k: v for k, v in message.items() if k != "tool_calls"}
            out.append({**rest, "content": f"{text}\n{calls}" if text else calls})
        else:
            out.append(message)
    out = [{k: v for k, v in m.items() if k != "tool_results"} for m in out]
    if tools:
        section = tool_section(tools)
        if out and out[0].get("role") == "system":
            system = content_text(out[0].get("content"))
            out[0] = {**out[0], "content": f"{system}\n\n{section}" if system else section}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


def call_text(call: Mapping[str, Any]) -> str:
    """One conversation call (a function call, or a custom call with its raw `input`) in the
    built-in shape."""
    custom = call.get("custom")
    if call.get("type") == "custom" and isinstance(custom, Mapping):
        return f'{INPUT_OPEN}{custom.get("name", "")}">\n{custom.get("input", "")}{INPUT_CLOSE}'
    name, arguments = call_parts(call)
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}"


def custom_as_function(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
) -> tuple[list[Mapping[str, Any]], list[Mapping[str, Any]] | None]:
    """For templates with their own tool format: each custom tool as a function of one string
    argument `input`, and each earlier custom call as a call of that function."""
    declared = [_as_function(tool) if is_custom(tool) else tool for tool in tools or ()]
    out: list[Mapping[str, Any]] = []
    for message in messages:
        calls = message.get("tool_calls")
        if isinstance(calls, list) and any(_is_custom_call(call) for call in calls):
            message = {**message, "tool_calls": [_call_as_function(call) for call in calls]}
        out.append(message)
    return out, (declared or None)


def _declaration(tool: Mapping[str, Any]) -> dict[str, Any]:
    if is_custom(tool):
        custom = tool["custom"]
        declared: dict[str, Any] = {"name": custom.get("name"), "input": "freeform"}
        if custom.get("description"):
            declared["description"] = custom["description"]
        fmt = custom.get("format")
        if isinstance(fmt, Mapping) and fmt.get("type") == "grammar":
            declared["format"] = {"syntax": fmt.get("syntax"), "definition": fmt.get("definition")}
        return declared
    function = tool.get("function", tool)
    keys = ("name", "description", "parameters")
    return {key: function[key] for key in keys if key in function}


def _as_function(tool: Mapping[str, Any]) -> dict[str, Any]:
    custom = tool["custom"]
    description = str(custom.get("description") or "")
    fmt = custom.get("format")
    if isinstance(fmt, Mapping) and fmt.get("type") == "grammar":
        grammar = f"`input` follows this {fmt.get('syntax')} grammar:\n{fmt.get('definition')}"
        description = f"{description}\n\n{grammar}".strip()
    parameters = {
        "type": "object",
        "properties": {"input": {"type": "string", "description": "the raw input"}},
        "required": ["input"],
    }
    function = {"name": custom.get("name"), "description": description, "parameters": parameters}
    return {"type": "function", "function": function}


def _is_custom_call(call: Any) -> bool:
    return isinstance(call, Mapping) and call.get("type") == "custom"


def _call_as_function(call: Any) -> Any:
    if not _is_custom_call(call):
        return call
    custom = call.get("custom") or {}
    arguments = {"input": str(custom.get("input", ""))}
    function = {"name": custom.get("name", ""), "arguments": arguments}
    return {"id": call.get("id"), "type": "function", "function": function}
