"""A forced tool choice (`required`, a named function; Anthropic `any`, `tool`) as a grammar.

The call is constrained to one JSON object `{"name": …, "arguments": {…}}` whose arguments follow
the tool's parameter schema, whatever the family's native markup: even a model that has never
seen a tool then returns a call that parses and validates. The tool-call parser reads that bare
object as the call. When no grammar engine is available, `instruction` asks for the same shape.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from modelhost.inference.contracts import GrammarSpec, InvalidRequest


def forced_call(
    tools: Sequence[Mapping[str, Any]], name: str | None, *, param: str = "tool_choice"
) -> tuple[GrammarSpec, str]:
    """(grammar, prompt instruction) forcing one call to `name`, or to any of `tools`."""
    functions = [function for tool in tools if (function := _function(tool)) is not None]
    if name is not None:
        functions = [function for function in functions if function["name"] == name]
        if not functions:
            raise InvalidRequest(f"tool_choice names an unknown tool {name!r}", param=param)
    if not functions:
        raise InvalidRequest("tool_choice forces a call but no tools were given", param=param)
    options = [_call_schema(function) for function in functions]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    text = json.dumps(schema, ensure_ascii=False)
    instruction = (
        "Call a tool now. Respond only with a JSON object "
        f'{{"name": <tool name>, "arguments": {{...}}}} matching this JSON schema:\n{text}'
    )
    return GrammarSpec("json_schema", text, field="tools"), instruction


def _function(tool: Mapping[str, Any]) -> Mapping[str, Any] | None:
    function = tool.get("function", tool)
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        return None
    return function


def _call_schema(function: Mapping[str, Any]) -> dict[str, Any]:
    parameters = function.get("parameters")
    if not isinstance(parameters, Mapping) or not parameters:
        parameters = {"type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": dict(parameters)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
