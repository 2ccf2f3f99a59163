"""The built-in tool prompt: what a model whose template cannot render tools reads."""

from __future__ import annotations

import json
from typing import Any

from modelhost.text.tool_calls import ToolCallParser
from modelhost.text.tool_prompt import builtin_tool_messages, call_text, custom_as_function

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
PATCH: dict[str, Any] = {
    "type": "custom",
    "custom": {
        "name": "apply_patch",
        "description": "Edit files",
        "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch"'},
    },
}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {}}}


def test_each_tool_is_declared_in_the_system_message_with_its_schema() -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Paris?"}]
    [system, user] = builtin_tool_messages(messages, [WEATHER])
    assert system["content"].startswith("Be brief.\n\n# Tools")
    declared = json.dumps(
        {
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": WEATHER["function"]["parameters"],
        }
    )
    assert declared in system["content"]
    assert '<tool_call>\n{"name": "<function name>"' in system["content"]
    assert user == messages[1]


def test_a_conversation_without_a_system_message_gains_one_for_the_tools() -> None:
    [system, _] = builtin_tool_messages([{"role": "user", "content": "Paris?"}], [WEATHER])
    assert system["role"] == "system"
    assert '"name": "get_weather"' in system["content"]


def test_earlier_calls_are_written_back_in_the_shape_the_model_writes_them() -> None:
    assistant = {"role": "assistant", "content": "", "tool_calls": [CALL]}
    [_, rewritten] = builtin_tool_messages([{"role": "user", "content": "?"}, assistant], None)
    assert rewritten["content"] == call_text(CALL)
    assert "tool_calls" not in rewritten
    [parsed] = ToolCallParser().parse(rewritten["content"]) or ()
    assert (parsed.name, parsed.arguments) == ("get_weather", "{}")


def test_consecutive_tool_results_come_back_as_one_user_turn_of_response_blocks() -> None:
    messages = [
        {"role": "user", "content": "?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL, CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_1", "content": "windy"},
        {"role": "user", "content": "thanks"},
    ]
    out = builtin_tool_messages(messages, None)
    assert [m["role"] for m in out] == ["user", "assistant", "user", "user"]
    assert out[2]["content"] == (
        "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nwindy\n</tool_response>"
    )
    assert all("tool_results" not in m for m in out)


def test_a_freeform_tool_is_declared_with_its_grammar_and_the_raw_input_shape() -> None:
    [system, _] = builtin_tool_messages([{"role": "user", "content": "edit"}], [PATCH])
    assert '"name": "apply_patch", "input": "freeform"' in system["content"]
    assert '"syntax": "lark", "definition": "start: \\"*** Begin Patch\\""' in system["content"]
    assert '<tool_input name="<tool name>">' in system["content"]
    assert "<tool_call>" not in system["content"]  # no function to call: no function shape


def test_an_earlier_freeform_call_is_its_raw_input_in_a_tool_input_block() -> None:
    call = {"id": "c", "type": "custom", "custom": {"name": "apply_patch", "input": "x\n"}}
    assert call_text(call) == '<tool_input name="apply_patch">\nx\n</tool_input>'
    [parsed] = ToolCallParser(tool_names=["apply_patch"]).parse(call_text(call)) or ()
    assert (parsed.name, parsed.input) == ("apply_patch", "x\n")


def test_templates_with_their_own_tool_format_see_a_freeform_tool_as_a_function_of_input() -> None:
    call = {"id": "c", "type": "custom", "custom": {"name": "apply_patch", "input": "x"}}
    messages = [{"role": "assistant", "content": "", "tool_calls": [call]}]
    out, tools = custom_as_function(messages, [WEATHER, PATCH])
    assert tools is not None
    assert tools[0] == WEATHER
    function = tools[1]["function"]
    assert function["name"] == "apply_patch"
    assert function["parameters"]["required"] == ["input"]
    assert 'start: "*** Begin Patch"' in function["description"]
    [rewritten] = out[0]["tool_calls"]
    assert rewritten["function"] == {"name": "apply_patch", "arguments": {"input": "x"}}
