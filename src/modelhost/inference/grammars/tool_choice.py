"""Tool choices as grammars: a forced call, and a model left to choose under the built-in prompt.

A forced choice (`required`, a named function; Anthropic `any`, `tool`) constrains the answer to
one JSON object `{"name": …, "arguments": {…}}` whose arguments follow the tool's parameter
schema, whatever the family's native markup: even a model that has never seen a tool then
returns a call that parses and validates. The tool-call parser reads that bare object as the
call. When no grammar engine is available, `instruction` asks for the same shape. A forced
freeform (`custom`) tool is its raw input in the built-in `<tool_input>` block instead, held to
the tool's own format (a Lark or regex grammar) when it has one.

`lazy_tool_grammar`: under the built-in tool prompt (text/tool_prompt.py) a model left to choose
writes free text, and once it opens a call (`<tool_call>`, `<tool_input name="`) the grammar
holds the rest of that call to the tool's schema or format (xgrammar's triggered tags).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from modelhost.inference.contracts import GrammarSpec, InvalidRequest
from modelhost.text.tool_prompt import CALL_CLOSE, CALL_OPEN, INPUT_CLOSE, INPUT_OPEN, is_custom


def forced_call(
    tools: Sequence[Mapping[str, Any]], name: str | None, *, param: str = "tool_choice"
) -> tuple[GrammarSpec, str]:
    """(grammar, prompt instruction) forcing one call to `name`, or to any of `tools`."""
    functions = [function for tool in tools if (function := _function(tool)) is not None]
    customs = [tool["custom"] for tool in tools if is_custom(tool)]
    if name is not None:
        functions = [function for function in functions if function["name"] == name]
        customs = [custom for custom in customs if custom.get("name") == name]
        if not functions and not customs:
            raise InvalidRequest(f"tool_choice names an unknown tool {name!r}", param=param)
    if not functions and not customs:
        raise InvalidRequest("tool_choice forces a call but no tools were given", param=param)
    if customs:  # raw input in its block: one of the tags, nothing before or after
        tags = [_function_tag(function) for function in functions]
        tags += [_input_tag(custom) for custom in customs]
        tag = {"type": "or", "elements": tags} if len(tags) > 1 else tags[0]
        source = json.dumps({"type": "structural_tag", "format": tag}, ensure_ascii=False)
        instruction = f"Call a tool now, in the {INPUT_OPEN}...{INPUT_CLOSE} shape shown above."
        return GrammarSpec("structural_tag", source, field="tools"), instruction
    options = [_call_schema(function) for function in functions]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    text = json.dumps(schema, ensure_ascii=False)
    instruction = (
        "Call a tool now. Respond only with a JSON object "
        f'{{"name": <tool name>, "arguments": {{...}}}} matching this JSON schema:\n{text}'
    )
    return GrammarSpec("json_schema", text, field="tools"), instruction


def lazy_tool_grammar(tools: Sequence[Mapping[str, Any]]) -> GrammarSpec | None:
    """Free text, and every call the model opens in the built-in shape held to its tool's
    schema or format; None when no tool is declared."""
    functions = [function for tool in tools if (function := _function(tool)) is not None]
    tags = [_function_tag(function) for function in functions]
    tags += [_input_tag(tool["custom"]) for tool in tools if is_custom(tool)]
    if not tags:
        return None
    triggers = [CALL_OPEN] * bool(functions) + [INPUT_OPEN] * (len(tags) > len(functions))
    fmt = {"type": "triggered_tags", "triggers": triggers, "tags": tags}
    source = json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False)
    return GrammarSpec("structural_tag", source, field="tools")


def _function_tag(function: Mapping[str, Any]) -> dict[str, Any]:
    """`<tool_call>` newline, `{"name": NAME, "arguments": ` ARGS `}` newline `</tool_call>`."""
    name = json.dumps(function["name"], ensure_ascii=False)
    return {
        "type": "tag",
        "begin": f'{CALL_OPEN}\n{{"name": {name}, "arguments": ',
        "content": {"type": "json_schema", "json_schema": _parameters(function)},
        "end": f"}}\n{CALL_CLOSE}",
    }


def _input_tag(custom: Mapping[str, Any]) -> dict[str, Any]:
    """`<tool_input name="NAME">` newline, the raw input in the tool's format, `</tool_input>`."""
    fmt = custom.get("format")
    content: dict[str, Any] = {"type": "any_text"}
    if isinstance(fmt, Mapping) and fmt.get("type") == "grammar":
        syntax, definition = fmt.get("syntax"), str(fmt.get("definition") or "")
        if syntax == "lark":
            content = {"type": "grammar", "grammar": definition, "syntax": "lark"}
        elif syntax == "regex":
            content = {"type": "regex", "pattern": definition}
        else:
            raise InvalidRequest(
                f"tool {custom.get('name')!r}: format.syntax must be 'lark' or 'regex'",
                param="tools",
            )
    return {
        "type": "tag",
        "begin": f'{INPUT_OPEN}{custom.get("name")}">\n',
        "content": content,
        "end": INPUT_CLOSE,
    }


def _parameters(function: Mapping[str, Any]) -> dict[str, Any]:
    parameters = function.get("parameters")
    if not isinstance(parameters, Mapping) or not parameters:
        return {"type": "object"}
    return dict(parameters)


def _function(tool: Mapping[str, Any]) -> Mapping[str, Any] | None:
    if is_custom(tool):
        return None
    function = tool.get("function", tool)
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        return None
    return function


def _call_schema(function: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": _parameters(function)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
