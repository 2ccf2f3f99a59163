"""Tool calls parsed out of generated text, streaming, so markup never reaches the content.

Text streams through live until a tool-call start marker appears (the family's own, e.g. Qwen's
`<tool_call>`, plus the generic `<tool_call>` / `<function=` forms); a tail that may be the start
of a marker is held back, as the stop matcher does. From the marker on, text is frozen. With
`bare_json`, output whose first non-space character is `{` or `[` is frozen from the start too:
Llama-3-style calls (and a call forced by a grammar) are a bare JSON object.

Families' own markers (families.py declares them): Qwen / Hermes / SmolLM3 `<tool_call>{..}
</tool_call>`; Phi-4-mini `<|tool_call|>[{..}]<|/tool_call|>` and Granite the same list without the
closing tag; Mistral `[TOOL_CALLS][{..}]` (v3) or `[TOOL_CALLS]name[ARGS]{..}` (later tokenizers,
one marker per call, `[CALL_ID]id` optionally between). A marker with an empty end runs to the
next start marker or the end of the text.

Gemma writes its calls as Python in a fenced block (`TOOL_CODE`: ```tool_code, then
`get_weather(city="Paris")`, then ```). With `python_list` (the pythonic dialect: Llama 3.2's
lightweight models, Gemma 3's template of that form) a bare answer may be a Python list of calls,
`[get_weather(city="Paris"), other(x=1)]`; it starts with `[`, so it is frozen like bare JSON.
Both are read with `ast`, never run: only plain calls whose arguments are all keyword literals
(strings, numbers, True/False/None, lists, dicts) count; anything else stays text.

`finish()` parses the frozen text. If every piece of markup parses, the calls are returned and
the markup is dropped; otherwise the frozen text is released as content (fail-soft): a model's
malformed call is shown, never lost.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

GENERIC_MARKERS: tuple[tuple[str, str], ...] = (
    ("<tool_call>", "</tool_call>"),
    ("<function=", "</function>"),
)
TOOL_CODE = ("```tool_code", "```")  # Gemma's fenced Python calls
MISTRAL_START = "[TOOL_CALLS]"
_MISTRAL_ARGS = "[ARGS]"
_MISTRAL_CALL_ID = "[CALL_ID]"
_PYTHON_TAG = "<|python_tag|>"  # Llama 3 prefixes some JSON calls with it
_XML_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)(?:</function>|$)", re.DOTALL)
_XML_PARAMETER = re.compile(
    r"<parameter=([^>\s]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL
)


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object as text, as OpenAI's wire carries it
    input: str | None = None  # a custom (freeform) tool's raw input; `arguments` is then "{}"

    def arguments_object(self) -> dict[str, Any]:
        value = json.loads(self.arguments)
        return value if isinstance(value, dict) else {}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:8]}"


class ToolCallParser:
    def __init__(
        self,
        markers: Iterable[tuple[str, str]] = (),
        *,
        bare_json: bool = True,
        tool_names: Iterable[str] = (),
        python_list: bool = False,
    ) -> None:
        self._pairs = tuple(dict.fromkeys((*markers, *GENERIC_MARKERS)))
        self._starts = tuple(dict.fromkeys(start for start, _ in self._pairs))
        self._prefixes = frozenset(s[:i] for s in self._starts for i in range(1, len(s)))
        self._bare_json = bare_json
        self._names = frozenset(tool_names)
        self._python_list = python_list
        self._pending = ""  # held back: may be a marker's start
        self._frozen: str | None = None  # text from the first marker on
        self._seen_text = False  # any non-space text went out (bare JSON must come first)

    @property
    def capturing(self) -> bool:
        return self._frozen is not None

    def push(self, text: str) -> str:
        """Take a delta; return the content that is safe to show now."""
        if self._frozen is not None:
            self._frozen += text
            return ""
        pending = self._pending + text
        if self._bare_json and not self._seen_text:
            stripped = pending.lstrip()
            if stripped.startswith(("{", "[", _PYTHON_TAG)):
                self._frozen, self._pending = pending, ""
                return ""
            if not stripped or _PYTHON_TAG.startswith(stripped):
                self._pending = pending  # still undecided: only space, or a tag's prefix
                return ""
        starts = [i for i in (pending.find(s) for s in self._starts) if i != -1]
        if starts:
            index = min(starts)
            self._frozen, self._pending = pending[index:], ""
            return self._shown(pending[:index])
        held = self._held_length(pending)
        self._pending = pending[len(pending) - held :]
        return self._shown(pending[: len(pending) - held])

    def finish(self) -> tuple[str, tuple[ToolCall, ...]]:
        """At the end of generation: (content still to show, the calls parsed)."""
        frozen, pending = self._frozen, self._pending
        self._frozen, self._pending = None, ""
        if frozen is None:
            return pending, ()
        calls = self.parse(frozen)
        if calls is None:
            return frozen, ()
        return "", calls

    def parse(self, text: str) -> tuple[ToolCall, ...] | None:
        """Every call in `text` (markup only, surrounding space allowed), or None if any part
        of it does not parse."""
        body = text.strip()
        if body.startswith(_PYTHON_TAG):
            body = body[len(_PYTHON_TAG) :].strip()
        if body.startswith(("{", "[")) and not body.startswith(self._starts):
            return self._bare(body)
        calls: list[ToolCall] = []
        while body:
            pair = next(((s, e) for s, e in self._pairs if body.startswith(s)), None)
            if pair is None:
                return None  # prose after the markup: not a clean call
            start, end = pair
            if end:
                close = body.find(end, len(start))
                segment = body[: close + len(end)] if close != -1 else body  # truncated: last
            else:  # runs to the next call's marker
                close = body.find(start, len(start))
                segment = body[:close] if close != -1 else body
            body = body[len(segment) :].strip()
            if start == "<function=":
                parsed = _xml_calls(segment)
            elif start == TOOL_CODE[0]:
                parsed = _python_calls(segment, start, end, self._names)
            elif start == MISTRAL_START:
                parsed = _mistral_calls(segment[len(start) :])
            else:
                parsed = _json_call(segment, start, end)
            if parsed is None:
                return None
            calls.extend(parsed)
        return tuple(calls) or None

    def _bare(self, body: str) -> tuple[ToolCall, ...] | None:
        calls = _json_calls(body)
        if calls is None and self._python_list and body.startswith("["):
            calls = _python_list_calls(body, self._names)
        if calls is None:
            return None
        # Bare JSON is also what a plain JSON answer looks like: only a known tool counts.
        if self._names and any(call.name not in self._names for call in calls):
            return None
        return tuple(calls)

    def _shown(self, text: str) -> str:
        if text.strip():
            self._seen_text = True
        return text

    def _held_length(self, pending: str) -> int:
        longest = max((len(s) - 1 for s in self._starts), default=0)
        for length in range(min(len(pending), longest), 0, -1):
            if pending[-length:] in self._prefixes:
                return length
        return 0


def _json_call(segment: str, start: str, end: str) -> list[ToolCall] | None:
    inner = segment[len(start) :]
    if inner.endswith(end):
        inner = inner[: -len(end)]
    inner = inner.strip()
    if inner.startswith("<function="):  # some Qwen variants nest the XML form in the tag
        return _xml_calls(inner)
    return _json_calls(inner)


def _json_calls(text: str) -> list[ToolCall] | None:
    """One call object, or a list of them (Phi, Granite, Mistral v3), as JSON text."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    calls = [_call_from(item) for item in (value if isinstance(value, list) else [value])]
    if not calls or any(call is None for call in calls):
        return None
    return [call for call in calls if call is not None]


def _mistral_calls(inner: str) -> list[ToolCall] | None:
    """After one `[TOOL_CALLS]`: a JSON list (v3), or `name[ARGS]{..}` with an optional
    `[CALL_ID]id` after the name (later tokenizers)."""
    inner = inner.strip()
    if inner.startswith(("[", "{")):
        return _json_calls(inner)
    head, found, arguments = inner.partition(_MISTRAL_ARGS)
    name = head.partition(_MISTRAL_CALL_ID)[0].strip()
    if not found or not name or any(c.isspace() for c in name):
        return None
    call = _call_from({"name": name, "arguments": arguments.strip()})
    return None if call is None else [call]


def _call_from(value: Any) -> ToolCall | None:
    """`{name, arguments|parameters}` (arguments an object or a JSON string) → a call."""
    if not isinstance(value, dict):
        return None
    if isinstance(value.get("function"), dict):  # OpenAI's own shape, echoed by some models
        value = value["function"]
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    text = json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))
    return ToolCall(new_call_id(), name, text)


def _xml_calls(segment: str) -> list[ToolCall] | None:
    """Qwen-coder's `<function=name><parameter=key>value</parameter></function>`."""
    calls: list[ToolCall] = []
    for match in _XML_FUNCTION.finditer(segment):
        arguments: dict[str, Any] = {}
        for key, raw in _XML_PARAMETER.findall(match.group(2)):
            value = raw.strip()
            try:
                arguments[key] = json.loads(value)  # numbers, booleans, objects
            except ValueError:
                arguments[key] = value
        text = json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))
        calls.append(ToolCall(new_call_id(), match.group(1), text))
    return calls or None


def _python_calls(
    segment: str, start: str, end: str, names: frozenset[str]
) -> list[ToolCall] | None:
    """Gemma's fenced `name(key=literal, ...)` lines; None unless every statement is such a call
    (to a known tool, when the tools are known)."""
    inner = segment[len(start) :]
    if inner.endswith(end):
        inner = inner[: -len(end)]
    tree = _python_tree(inner.strip(), "exec")
    if not isinstance(tree, ast.Module):
        return None
    statements = tree.body
    return _calls_of([s.value if isinstance(s, ast.Expr) else None for s in statements], names)


def _python_list_calls(text: str, names: frozenset[str]) -> list[ToolCall] | None:
    """The pythonic form, `[name(key=literal, ...), ...]`; None unless it is one list whose
    every element is such a call (to a known tool, when the tools are known)."""
    tree = _python_tree(text, "eval")
    if not isinstance(tree, ast.Expression) or not isinstance(tree.body, ast.List):
        return None
    return _calls_of(list(tree.body.elts), names)


def _python_tree(source: str, mode: str) -> ast.AST | None:
    try:
        return ast.parse(source, mode=mode)
    except (SyntaxError, ValueError, MemoryError, RecursionError):  # ValueError: a NUL byte
        return None


def _calls_of(nodes: list[ast.expr | None], names: frozenset[str]) -> list[ToolCall] | None:
    calls: list[ToolCall] = []
    for node in nodes:
        call = _literal_call(node, names)
        if call is None:
            return None
        calls.append(call)
    return calls or None


def _literal_call(node: ast.expr | None, names: frozenset[str]) -> ToolCall | None:
    """`name(key=literal, ...)` as a call; None for anything else (positional or `**` arguments,
    an attribute or computed callee, a value that is not a literal JSON can carry)."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    name = node.func.id
    if names and name not in names:
        return None
    arguments: dict[str, Any] = {}
    for keyword in node.keywords:
        if keyword.arg is None:  # **kwargs
            return None
        try:
            arguments[keyword.arg] = ast.literal_eval(keyword.value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
    try:
        text = json.dumps(arguments, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError):  # a literal JSON cannot carry (bytes, sets, nan)
        return None
    return ToolCall(new_call_id(), name, text)
