"""A conversation reshaped for templates that want it in a form of their own.

Shapes real templates insist on (Gemma's tool_code turns are in tool_code.py):

- Mistral's templates raise unless every call id is 9 alphanumerics, while OpenAI clients send
  `call_...` ids and Anthropic ones `toolu_...`. Each id is replaced by a digest of itself, so a
  call and its result still pair up.
- Phi-4-mini's template ignores the `tools` variable: it prints a system message's own `tools`
  string between `<|tool|>` tags, and prints only an assistant turn's content. The declarations
  go into the system message and earlier calls into the content, in the markup the model writes.
- Gemma 2's template raises on a system message: its text joins the first user turn, as
  Gemma 3's template does by itself.
- Many templates (Gemma's, Mistral's) take a system turn only first; a system turn later in the
  conversation joins the user turn next to it, in place, never hoisted to the front (which
  would change the prompt's start, and the cached prefix, on every turn).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from modelhost.text.tool_code import call_parts


def fixed_length_call_ids(
    messages: Sequence[Mapping[str, Any]], length: int
) -> list[Mapping[str, Any]]:
    """`messages` with every tool-call id (and each result's `tool_call_id`) `length` long."""
    out: list[Mapping[str, Any]] = []
    for message in messages:
        if message.get("tool_calls"):
            calls = [
                {**call, "id": _fixed(call.get("id"), length)}
                if isinstance(call, Mapping)
                else call
                for call in message["tool_calls"]
            ]
            message = {**message, "tool_calls": calls}
        if message.get("role") == "tool" and "tool_call_id" in message:
            message = {**message, "tool_call_id": _fixed(message["tool_call_id"], length)}
        out.append(message)
    return out


def _fixed(call_id: Any, length: int) -> str:
    text = str(call_id or "")
    if len(text) == length and text.isalnum():
        return text
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def system_declared_tools(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    markers: tuple[str, str],
) -> list[Mapping[str, Any]]:
    """`messages` with `tools` as the system message's `tools` string (a JSON list of the
    functions) and earlier assistant calls written as `start[{name, arguments}, ...]end`."""
    out: list[Mapping[str, Any]] = []
    start, end = markers
    for message in messages:
        if message.get("role") == "assistant" and message.get("tool_calls"):
            calls = [_call_object(call) for call in message["tool_calls"]]
            text = str(message.get("content") or "")
            markup = f"{start}{json.dumps(calls, ensure_ascii=False)}{end}"
            message = {key: value for key, value in message.items() if key != "tool_calls"}
            message["content"] = f"{text}{markup}"
        out.append(message)
    if tools:
        declared = json.dumps([tool.get("function", tool) for tool in tools], ensure_ascii=False)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "tools": declared}
        else:
            out.insert(0, {"role": "system", "content": "", "tools": declared})
    return out


def _call_object(call: Mapping[str, Any]) -> dict[str, Any]:
    name, arguments = call_parts(call)
    return {"name": name, "arguments": arguments}


def system_in_first_user_turn(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """`messages` without system turns: the leading ones' text opens the first user turn, a
    later one's joins the user turn next to it (`later_system_in_user_turns`)."""
    lead = _leading_system(messages)
    rest: list[Mapping[str, Any]] = list(later_system_in_user_turns(messages[lead:]))
    prefix = "\n\n".join(_text(message) for message in messages[:lead] if _text(message))
    if not prefix:
        return rest
    for index, message in enumerate(rest):
        if message.get("role") == "user" and isinstance(message.get("content"), str):
            rest[index] = {**message, "content": f"{prefix}\n\n{message['content']}"}
            return rest
    return [{"role": "user", "content": prefix}, *rest]


def later_system_in_user_turns(
    messages: Sequence[Mapping[str, Any]],
) -> list[dict[str, Any]]:
    """`messages` with each system turn after the conversation began folded into the next user
    turn's text (the previous one's when no user turn follows), for templates that take a system
    turn only first. The turns before it stay as they were, so a cached prefix still matches."""
    out = [dict(message) for message in messages]
    lead = _leading_system(out)
    index = lead
    while index < len(out):
        if out[index].get("role") != "system":
            index += 1
            continue
        text = _text(out.pop(index))
        users = [i for i, message in enumerate(out) if message.get("role") == "user"]
        after = next((i for i in users if i >= index), None)
        before = next((i for i in reversed(users) if lead <= i < index), None)
        if after is not None:
            out[after]["content"] = _joined(text, out[after].get("content"), first=True)
        elif before is not None:
            out[before]["content"] = _joined(text, out[before].get("content"), first=False)
        else:
            out.insert(index, {"role": "user", "content": text})
            index += 1
    return out


def has_later_system_turn(messages: Sequence[Mapping[str, Any]]) -> bool:
    """Whether a system turn comes after a turn of another role."""
    return any(m.get("role") == "system" for m in messages[_leading_system(messages) :])


def _leading_system(messages: Sequence[Mapping[str, Any]]) -> int:
    """How many system turns open the conversation."""
    lead = 0
    while lead < len(messages) and messages[lead].get("role") == "system":
        lead += 1
    return lead


def _text(message: Mapping[str, Any]) -> str:
    return str(message.get("content") or "")


def _joined(text: str, content: Any, *, first: bool) -> Any:
    """A user turn's content with `text` before it (`first`) or after it; a list of parts gets
    a text part."""
    if isinstance(content, list):
        part = {"type": "text", "text": text}
        return [part, *content] if first else [*content, part]
    own = str(content or "")
    if not own:
        return text
    return f"{text}\n\n{own}" if first else f"{own}\n\n{text}"
