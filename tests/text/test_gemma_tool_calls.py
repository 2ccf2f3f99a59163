"""Gemma's tool-call markup (a ```tool_code fence of Python-style calls), as a user sees it."""

from __future__ import annotations

import json

from modelhost.models.families import family_for
from modelhost.text.tool_calls import TOOL_CODE, ToolCall, ToolCallParser

TOOLS = ["get_weather", "get_time"]
# Deltas as Gemma 3's tokenizer splits a call: the fence and the tag arrive in pieces.
RECORDED = [
    "Let me check",
    ".",
    "\n",
    "```",
    "tool",
    "_",
    "code",
    "\n",
    "get",
    "_weather",
    "(",
    "city",
    '="',
    "Paris",
    '",',
    " days",
    "=",
    "3",
    ")",
    "\n",
    "```",
]


def gemma_parser() -> ToolCallParser:
    markers = family_for("gemma3_text").tool_call_markers
    assert markers is not None
    return ToolCallParser([markers], tool_names=TOOLS)


def run(parser: ToolCallParser, deltas: list[str]) -> tuple[str, tuple[ToolCall, ...]]:
    shown = "".join(parser.push(delta) for delta in deltas)
    rest, calls = parser.finish()
    return shown + rest, calls


def named(calls: tuple[ToolCall, ...]) -> list[tuple[str, object]]:
    return [(call.name, json.loads(call.arguments)) for call in calls]


def fenced(body: str) -> str:
    return f"```tool_code\n{body}\n```"


def test_the_gemma_family_record_declares_the_tool_code_fence() -> None:
    assert family_for("gemma3").tool_call_markers == TOOL_CODE


def test_a_recorded_gemma_call_becomes_a_call_with_json_arguments() -> None:
    content, calls = run(gemma_parser(), RECORDED)

    assert content == "Let me check.\n"
    assert named(calls) == [("get_weather", {"city": "Paris", "days": 3})]


def test_the_fence_is_held_back_while_it_may_be_starting() -> None:
    parser = gemma_parser()

    shown = [parser.push(delta) for delta in RECORDED[:6]]

    assert "".join(shown) == "Let me check.\n"
    assert not any("`" in piece for piece in shown)


def test_a_fence_split_into_single_characters_never_leaks() -> None:
    parser = gemma_parser()
    text = "Checking. " + fenced('get_time(zone="UTC")')

    shown = [parser.push(char) for char in text]
    rest, calls = parser.finish()

    assert "".join(shown) + rest == "Checking. "
    assert named(calls) == [("get_time", {"zone": "UTC"})]


def test_several_calls_in_one_block_are_all_returned_in_order() -> None:
    body = 'get_weather(city="Oslo")\nget_time(zone="CET")'

    _, calls = run(gemma_parser(), [fenced(body)])

    assert named(calls) == [("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "CET"})]


def test_python_literals_become_their_json_counterparts() -> None:
    body = 'get_weather(city="Rome", units=None, hourly=True, days=(1, 2), extra={"a": -1.5})'

    _, calls = run(gemma_parser(), [fenced(body)])

    assert named(calls) == [
        (
            "get_weather",
            {"city": "Rome", "units": None, "hourly": True, "days": [1, 2], "extra": {"a": -1.5}},
        )
    ]


def test_a_call_with_a_non_literal_argument_is_released_as_text() -> None:
    markup = fenced('get_weather(city=open("/etc/passwd").read())')

    content, calls = run(gemma_parser(), list(markup))

    assert content == markup
    assert calls == ()


def test_a_call_with_a_positional_argument_is_released_as_text() -> None:
    markup = fenced('get_weather("Paris")')

    content, calls = run(gemma_parser(), [markup])

    assert (content, calls) == (markup, ())


def test_code_that_is_not_a_call_to_a_known_tool_is_released_as_text() -> None:
    for body in ('print("hi")', "x = 1", "get_weather(city=", 'os.system(cmd="ls")'):
        markup = fenced(body)

        content, calls = run(gemma_parser(), [markup])

        assert (content, calls) == (markup, ())


def test_an_ordinary_code_fence_passes_through_as_content() -> None:
    text = "Use:\n```python\nprint(1)\n```\n"

    content, calls = run(gemma_parser(), list(text))

    assert (content, calls) == (text, ())
