"""Gemma's tool turns in the prompt: calls as ```tool_code, results as ```tool_output."""

from __future__ import annotations

import json

from modelhost.text.tool_calls import TOOL_CODE, ToolCallParser
from modelhost.text.tool_code import tool_code_messages

TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object"}},
}
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
ASKED = {"role": "user", "content": "Weather in Paris?"}


def called(arguments: object) -> dict[str, object]:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{**CALL, "function": {"name": "get_weather", "arguments": arguments}}],
    }


def test_an_assistant_call_is_written_as_a_tool_code_fence() -> None:
    messages = tool_code_messages([ASKED, called('{"city": "Paris", "days": 3}')], None)

    assert messages[1] == {
        "role": "assistant",
        "content": "```tool_code\nget_weather(city='Paris', days=3)\n```",
    }


def test_a_written_call_parses_back_to_the_same_arguments() -> None:
    arguments = {"city": "Paris", "hourly": True, "units": None, "days": [1, 2]}
    [_, message] = tool_code_messages([ASKED, called(arguments)], None)
    parser = ToolCallParser([TOOL_CODE])

    parser.push(message["content"])
    _, [call] = parser.finish()

    assert (call.name, json.loads(call.arguments)) == ("get_weather", arguments)


def test_tool_results_come_back_as_one_user_turn_of_tool_output_fences() -> None:
    results = [
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "22C"}]},
    ]

    messages = tool_code_messages([ASKED, called({}), *results], None)

    assert messages[2:] == [
        {"role": "user", "content": "```tool_output\nsunny\n```\n```tool_output\n22C\n```"}
    ]


def test_the_tools_are_declared_in_the_system_text() -> None:
    system = {"role": "system", "content": "Be brief."}

    [first, _] = tool_code_messages([system, ASKED], [TOOL])

    assert first["role"] == "system" and first["content"].startswith("Be brief.\n\n")
    assert "```tool_code" in first["content"]
    assert json.dumps(TOOL["function"]) in first["content"]
