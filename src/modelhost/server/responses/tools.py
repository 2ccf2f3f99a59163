"""Responses API tools → the neutral tools a template renders, and parsed calls → output items.

| declared tool          | offered to the model as                          | its calls answer as |
| ---------------------- | ------------------------------------------------ | ------------------- |
| `function`             | `{type: function, function: {name, ...}}`        | `function_call`     |
| `custom` (freeform)    | `{type: custom, custom: {name, ..., format}}`    | `custom_tool_call`  |
| `namespace`            | its tools, each named `<namespace>__<name>`      | the same + namespace|
| anything else (hosted) | nothing: named in a header and the log; 400 when forced | -            |

A namespaced tool's flat name is Codex's own (`multi_agent_v1__spawn_agent`: the namespace, `__`,
the name), so a model sees one name per tool and the parser hands back a name that maps to the
pair; function names allow no dots in most templates' eyes, underscores they all take.
Hosted tools (`web_search`, `file_search`, `code_interpreter`, `computer_use_preview`,
`image_generation`, `mcp`, `local_shell`, `shell`, `apply_patch`, `tool_search`) are run by
OpenAI's servers or call for item types of their own; nothing here runs them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from modelhost.inference.contracts import GrammarSpec, InvalidRequest
from modelhost.inference.grammars.tool_choice import forced_call
from modelhost.server.tools_not_offered import forced_refusal
from modelhost.text.tool_calls import ToolCall
from modelhost.text.tool_prompt import tool_name

NAMESPACE_SEPARATOR = "__"  # Codex's flat form of a namespaced tool's name


@dataclass(frozen=True, slots=True)
class ResponsesTools:
    """What a request's `tools` and `tool_choice` come to."""

    offered: tuple[dict[str, Any], ...] | None  # the neutral tools; None: no tools this turn
    choice: Any  # `tool_choice`, to echo
    echo: list[dict[str, Any]] = field(default_factory=list)  # the declared tools offered
    not_offered: tuple[str, ...] = ()  # the types of the declared tools nothing here runs
    namespaced: Mapping[str, tuple[str, str]] = field(default_factory=dict)  # flat → (ns, name)
    forced: tuple[GrammarSpec, str] | None = None  # the grammar and instruction of a forced call


def flat_name(namespace: str, name: str) -> str:
    """A namespaced tool's one name, as Codex flattens it (stray underscores trimmed)."""
    return f"{namespace.rstrip('_')}{NAMESPACE_SEPARATOR}{name.lstrip('_')}"


def read_tools(body: Mapping[str, Any]) -> ResponsesTools:
    """The tools a Responses body declares, as offered, echoed, refused or forced."""
    declared = body.get("tools")
    if declared is not None and not isinstance(declared, list):
        raise InvalidRequest("tools must be of type list", param="tools")
    choice = body.get("tool_choice", "auto")
    offered: list[dict[str, Any]] = []
    echo: list[dict[str, Any]] = []
    not_offered: list[str] = []
    namespaced: dict[str, tuple[str, str]] = {}
    for index, tool in enumerate(declared or []):
        if not isinstance(tool, dict):
            raise InvalidRequest(f"tools[{index}] must be an object", param="tools")
        kind = tool.get("type")
        if kind in ("function", "custom"):
            offered.append(_neutral(tool, f"tools[{index}]"))
            echo.append(tool)
        elif kind == "namespace":
            members = _namespace(tool, f"tools[{index}]")
            for flat, name, neutral in members:
                namespaced[flat] = (str(tool["name"]), name)
                offered.append(neutral)
            echo.append(tool)
        else:
            not_offered.append(str(kind))
    offered = _allowed(offered, choice)
    tools = tuple(offered) if offered and choice != "none" else None
    forced = _forced(choice, tools, frozenset(not_offered))
    refused = tuple(dict.fromkeys(not_offered))
    return ResponsesTools(tools, choice, echo, refused, namespaced, forced)


def _neutral(tool: Mapping[str, Any], where: str, name: str | None = None) -> dict[str, Any]:
    """A function or custom tool in the neutral shape, under `name` when given (namespaced)."""
    if not isinstance(tool.get("name"), str):
        raise InvalidRequest(f"{where}.name must be of type str", param="tools")
    own = {"name": name or tool["name"]}
    if isinstance(tool.get("description"), str):
        own["description"] = tool["description"]
    if tool.get("type") == "custom":
        fmt = tool.get("format")
        own["format"] = fmt if isinstance(fmt, dict) else {"type": "text"}
        return {"type": "custom", "custom": own}
    if "parameters" in tool:
        own["parameters"] = tool["parameters"]
    return {"type": "function", "function": own}


def _namespace(tool: Mapping[str, Any], where: str) -> list[tuple[str, str, dict[str, Any]]]:
    """(flat name, own name, neutral tool) for each function or custom tool of a namespace."""
    namespace = tool.get("name")
    members = tool.get("tools")
    if not isinstance(namespace, str) or not isinstance(members, list):
        message = f"{where} must be a namespace with a name and a list of tools"
        raise InvalidRequest(message, param="tools")
    out = []
    for number, member in enumerate(members):
        at = f"{where}.tools[{number}]"
        if not isinstance(member, dict) or member.get("type") not in ("function", "custom"):
            raise InvalidRequest(f"{at} must be a function or custom tool", param="tools")
        flat = flat_name(namespace, str(member.get("name")))
        out.append((flat, str(member["name"]), _neutral(member, at, flat)))
    return out


def _allowed(offered: list[dict[str, Any]], choice: Any) -> list[dict[str, Any]]:
    """`offered` cut to the tools an `allowed_tools` choice names (hosted ones are not here)."""
    if not isinstance(choice, dict) or choice.get("type") != "allowed_tools":
        return offered
    names = set()
    for tool in choice.get("tools") or []:
        if isinstance(tool, dict) and isinstance(tool.get("name"), str):
            namespace = tool.get("namespace")
            name = tool["name"]
            names.add(flat_name(namespace, name) if isinstance(namespace, str) else name)
    return [tool for tool in offered if tool_name(tool) in names]


def _forced(
    choice: Any, tools: tuple[dict[str, Any], ...] | None, not_offered: frozenset[str]
) -> tuple[GrammarSpec, str] | None:
    """The forced call a `tool_choice` asks for: `required`, a named function or custom tool,
    `allowed_tools` in `required` mode; a 400 when it forces a tool nothing here runs."""
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind not in ("function", "custom", "allowed_tools"):
            raise forced_refusal(str(kind))
        if kind == "allowed_tools":
            return forced_call(tools, None) if tools and choice.get("mode") == "required" else None
        function = choice.get("function")  # chat's nested shape, which clients also send here
        name = function.get("name") if isinstance(function, dict) else choice.get("name")
        if not isinstance(name, str):
            raise InvalidRequest("tool_choice.name must be of type str", param="tool_choice")
        namespace = choice.get("namespace")
        if isinstance(namespace, str):
            name = flat_name(namespace, name)
        if not tools:
            raise InvalidRequest(f"tool_choice names an unknown tool {name!r}", "tool_choice")
        return forced_call(tools, name)
    if choice == "required" and tools:
        return forced_call(tools, None)
    if choice == "required" and not_offered:
        raise forced_refusal(", ".join(sorted(not_offered)))
    return None


# ---------------------------------------------------------------------------------------------
# Calls → output items


def call_item(
    item_id: str,
    call: ToolCall,
    status: str,
    namespaced: Mapping[str, tuple[str, str]],
    *,
    streaming: bool = False,
) -> dict[str, Any]:
    """A parsed call as its output item: `custom_tool_call` for a custom tool (its `input`),
    `function_call` otherwise; a namespaced tool's call names its namespace. `streaming`: the
    item as `output_item.added` shows it, before its input or arguments."""
    namespace, name = namespaced.get(call.name, (None, call.name))
    if call.input is not None:
        item: dict[str, Any] = {
            "id": item_id,
            "type": "custom_tool_call",
            "status": status,
            "call_id": call.id,
            "name": name,
            "input": "" if streaming else call.input,
        }
    else:
        item = {
            "id": item_id,
            "type": "function_call",
            "status": status,
            "call_id": call.id,
            "name": name,
            "arguments": "" if streaming else call.arguments,
        }
    if namespace is not None:
        item["namespace"] = namespace
    return item
