"""The tool-call parser: what a user sees of a stream that writes tool-call markup."""

from __future__ import annotations

import json

from modelhost.text.tool_calls import ToolCall, ToolCallParser

QWEN = ("<tool_call>", "</tool_call>")
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _run(parser: ToolCallParser, deltas: list[str]) -> tuple[str, tuple[ToolCall, ...]]:
    """The content a user would see after these deltas, and the calls parsed at the end."""
    shown = "".join(parser.push(delta) for delta in deltas)
    rest, calls = parser.finish()
    return shown + rest, calls


def _chars(text: str) -> list[str]:
    return list(text)


def test_a_qwen_call_becomes_a_call_with_json_string_arguments() -> None:
    content, calls = _run(ToolCallParser([QWEN]), [CALL])

    assert content == ""
    assert [(call.name, json.loads(call.arguments)) for call in calls] == [
        ("get_weather", {"city": "Paris"})
    ]


def test_call_ids_are_call_and_eight_hex_digits() -> None:
    _, calls = _run(ToolCallParser([QWEN]), [CALL])

    assert calls[0].id.startswith("call_") and len(calls[0].id) == len("call_") + 8
    int(calls[0].id.removeprefix("call_"), 16)


def test_markup_split_across_every_character_never_reaches_the_content() -> None:
    parser = ToolCallParser([QWEN])

    shown = [parser.push(char) for char in "Let me check. " + CALL]
    rest, calls = parser.finish()

    assert "".join(shown) + rest == "Let me check. "
    assert "<" not in "".join(shown)
    assert [call.name for call in calls] == ["get_weather"]


def test_text_that_only_looks_like_a_marker_start_is_released() -> None:
    content, calls = _run(ToolCallParser([QWEN]), _chars("a <tool and <b> too"))

    assert content == "a <tool and <b> too"
    assert calls == ()


def test_malformed_json_inside_the_markers_is_released_as_text() -> None:
    broken = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'

    content, calls = _run(ToolCallParser([QWEN]), _chars("Sure. " + broken))

    assert content == "Sure. " + broken
    assert calls == ()


def test_several_calls_in_a_row_all_parse_in_order() -> None:
    second = '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>'

    _, calls = _run(ToolCallParser([QWEN]), [CALL, "\n", second])

    assert [call.name for call in calls] == ["get_weather", "get_time"]


def test_a_call_cut_off_before_its_end_marker_still_parses() -> None:
    _, calls = _run(ToolCallParser([QWEN]), ['<tool_call>{"name": "f", "arguments": {}}'])

    assert [call.name for call in calls] == ["f"]


def test_a_bare_json_call_to_a_known_tool_is_a_call() -> None:
    parser = ToolCallParser(tool_names=["get_weather"])

    content, calls = _run(parser, _chars('{"name": "get_weather", "parameters": {"city": "Oslo"}}'))

    assert content == ""
    assert json.loads(calls[0].arguments) == {"city": "Oslo"}


def test_a_bare_json_answer_that_names_no_known_tool_stays_text() -> None:
    answer = '{"name": "Ada", "arguments": {}}'

    content, calls = _run(ToolCallParser(tool_names=["get_weather"]), _chars(answer))

    assert content == answer
    assert calls == ()


def test_json_after_prose_is_not_taken_for_a_bare_call() -> None:
    text = 'Here: {"name": "get_weather", "arguments": {}}'

    content, calls = _run(ToolCallParser(tool_names=["get_weather"]), _chars(text))

    assert content == text
    assert calls == ()


def test_the_xml_function_form_parses_its_parameters() -> None:
    xml = "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    xml += "<parameter=days>3</parameter>\n</function>"

    _, calls = _run(ToolCallParser(), _chars(xml))

    assert json.loads(calls[0].arguments) == {"city": "Paris", "days": 3}


def test_prose_after_a_call_releases_the_whole_markup_as_text() -> None:
    content, calls = _run(ToolCallParser([QWEN]), [CALL, " and then some words"])

    assert content == CALL + " and then some words"
    assert calls == ()


def test_a_freeform_input_streams_out_of_the_content_and_keeps_its_text_verbatim() -> None:
    parser = ToolCallParser(tool_names=["apply_patch"])
    text = 'Patching.<tool_input name="apply_patch">\n*** Begin Patch\n  x\n\n</tool_input>'
    shown = "".join(parser.push(text[i : i + 3]) for i in range(0, len(text), 3))
    rest, [call] = parser.finish()
    assert shown + rest == "Patching."
    assert (call.name, call.input, call.arguments) == (
        "apply_patch",
        "*** Begin Patch\n  x\n\n",
        "{}",
    )


def test_a_freeform_input_cut_off_before_its_close_is_released_as_content() -> None:
    parser = ToolCallParser(tool_names=["apply_patch"])
    text = '<tool_input name="apply_patch">\n*** Begin Patch\n'
    shown = parser.push(text)
    rest, calls = parser.finish()
    assert (shown + rest, calls) == (text, ())


def test_a_freeform_input_to_a_tool_not_offered_stays_text() -> None:
    parser = ToolCallParser(tool_names=["apply_patch"])
    text = '<tool_input name="rm">\n-rf /\n</tool_input>'
    rest, calls = (parser.push(text), parser.finish())[1]
    assert (rest, calls) == (text, ())
