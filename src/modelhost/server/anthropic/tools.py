"""Anthropic tools → the neutral function tools a template renders; the rest named, not dropped.

| declared tool                                  | offered to the model as                    |
| ---------------------------------------------- | ------------------------------------------ |
| a client tool (`input_schema`)                 | a function with that schema                |
| `bash_*`, `text_editor_*` (schemas Anthropic    | a function with the schema Anthropic       |
|   defines; the client runs them)               |   documents for that tool                  |
| server tools (`web_search_*`, `web_fetch_*`,   | nothing: named in a header and the log;    |
|   `code_execution_*`, `tool_search_tool_*`),   |   a 400 when `tool_choice` forces one      |
|   `computer_*`, `memory_*`, `mcp_toolset`      |                                            |

Server tools run on Anthropic's servers; `computer_*` needs screenshots back and a model
trained on its actions, `memory_*` a store of its own: nothing here runs or serves them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from modelhost.inference.contracts import GrammarSpec, InvalidRequest
from modelhost.inference.grammars.tool_choice import forced_call
from modelhost.server.openai import fields
from modelhost.server.tools_not_offered import forced_refusal

_BASH_SCHEMA = {
    "type": "object",
    "properties": {
        "command": {"type": "string", "description": "The bash command to run."},
        "restart": {"type": "boolean", "description": "Restart the shell session."},
    },
}
_EDITOR_COMMANDS = ["view", "create", "str_replace", "insert"]


def _editor_schema(commands: list[str]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "command": {"type": "string", "enum": commands},
            "path": {"type": "string", "description": "Absolute path to the file or directory."},
            "file_text": {"type": "string", "description": "The new file's text (create)."},
            "old_str": {"type": "string", "description": "The exact text to replace."},
            "new_str": {"type": "string", "description": "The text to put in its place."},
            "insert_line": {"type": "integer", "description": "Insert after this line."},
            "view_range": {"type": "array", "items": {"type": "integer"}},
        },
        "required": ["command", "path"],
    }


@dataclass(frozen=True, slots=True)
class AnthropicTools:
    offered: tuple[dict[str, Any], ...] | None  # the neutral function tools; None: none offered
    not_offered_names: Mapping[str, str]  # a refused tool's name → its type (for tool_choice)

    @property
    def not_offered(self) -> tuple[str, ...]:
        """The types of the declared tools nothing here runs, each once."""
        return tuple(dict.fromkeys(self.not_offered_names.values()))


def read_tools(body: dict[str, Any]) -> AnthropicTools:
    """The tools a Messages body declares, as offered or named as not offered."""
    raw = fields.field(body, "tools", list) or []
    choice = fields.field(body, "tool_choice", dict)
    functions: list[dict[str, Any]] = []
    refused: dict[str, str] = {}
    for index, tool in enumerate(raw):
        if not isinstance(tool, dict):
            raise InvalidRequest(f"tools[{index}] must be an object", param="tools")
        name, kind = tool.get("name"), str(tool.get("type") or "custom")
        schema = _schema_of(tool, kind)
        if schema is None:
            refused[str(name) if isinstance(name, str) else kind] = kind
            continue
        if not isinstance(name, str):
            raise InvalidRequest(f"tools[{index}].name must be of type str", param="tools")
        function = {"name": name, "parameters": schema}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        functions.append({"type": "function", "function": function})
    if not functions or (choice is not None and choice.get("type") == "none"):
        return AnthropicTools(None, refused)
    return AnthropicTools(tuple(functions), refused)


def _schema_of(tool: Mapping[str, Any], kind: str) -> Any:
    """The input schema a tool is offered with; None for a tool nothing here runs."""
    if "input_schema" in tool:
        return tool["input_schema"]
    if kind.startswith("bash_"):
        return _BASH_SCHEMA
    if kind.startswith("text_editor_"):
        # The 2025-04 and later editors dropped `undo_edit`; the earlier ones have it.
        late = kind >= "text_editor_20250429"
        return _editor_schema(_EDITOR_COMMANDS if late else [*_EDITOR_COMMANDS, "undo_edit"])
    return None


def forced_tool(body: dict[str, Any], tools: AnthropicTools) -> tuple[GrammarSpec, str] | None:
    """`tool_choice` `any` (some tool) or `tool` (the named one) as a grammar; None otherwise.
    Forcing a tool that is not offered is a 400 that names it."""
    choice = fields.field(body, "tool_choice", dict)
    if choice is None:
        return None
    kind = choice.get("type")
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str):
            raise InvalidRequest("tool_choice.name must be of type str", param="tool_choice")
        if name in tools.not_offered_names:
            raise forced_refusal(f"{name} ({tools.not_offered_names[name]})")
        return forced_call(tools.offered, name) if tools.offered else None
    if kind == "any":
        if tools.offered:
            return forced_call(tools.offered, None)
        if tools.not_offered:
            raise forced_refusal(", ".join(tools.not_offered))
    return None
