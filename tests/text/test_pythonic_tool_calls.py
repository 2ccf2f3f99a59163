"""The pythonic tool-call form (Llama 3.2's lightweight models): a bare Python list of calls,
`[get_weather(city="Paris"), other(x=1)]`, read with `ast` into calls with JSON arguments."""

from __future__ import annotations

import json

import pytest
from family_templates import template

from modelhost.models.families import family_for_model
from modelhost.text.tool_calls import ToolCall, ToolCallParser

TOOLS = ["get_weather", "get_time"]


def parser() -> ToolCallParser:
    dialect = family_for_model("llama", template("llama3_2_pythonic")).tool_dialect
    return ToolCallParser((), tool_names=TOOLS, python_list=dialect.python_list)


def run(deltas: list[str]) -> tuple[str, tuple[ToolCall, ...]]:
    reader = parser()
    shown = "".join(reader.push(delta) for delta in deltas)
    rest, calls = reader.finish()
    return shown + rest, calls


def arguments(calls: tuple[ToolCall, ...]) -> list[tuple[str, object]]:
    return [(call.name, json.loads(call.arguments)) for call in calls]


def test_a_list_of_calls_becomes_calls_in_order_with_no_content() -> None:
    text = '[get_weather(city="Paris"), get_time(zone="CET")]'

    content, calls = run(list(text))

    assert content == ""
    assert arguments(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]


def test_python_literals_become_their_json_counterparts() -> None:
    text = (
        "[get_weather(city='Paris', days=3, ratio=-0.5, metric=True, hourly=False, "
        "station=None, tags=['a', 'b'], where={'lat': 48.8, 'lon': 2.3})]"
    )

    _, calls = run([text])

    assert arguments(calls) == [
        (
            "get_weather",
            {
                "city": "Paris",
                "days": 3,
                "ratio": -0.5,
                "metric": True,
                "hourly": False,
                "station": None,
                "tags": ["a", "b"],
                "where": {"lat": 48.8, "lon": 2.3},
            },
        )
    ]


def test_a_call_after_the_python_tag_still_parses() -> None:
    assert arguments(run(["<|python_tag|>", "[get_time()]"])[1]) == [("get_time", {})]


def test_a_bare_json_call_still_parses_in_the_pythonic_dialect() -> None:
    text = '{"name": "get_weather", "arguments": {"city": "Paris"}}'

    assert arguments(run([text])[1]) == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize(
    "text",
    [
        '[get_weather("Paris")]',  # positional
        "[get_weather(city=open('/etc/passwd').read())]",  # not a literal: never run
        "[get_weather(**{'city': 'Paris'})]",
        "[os.system(cmd='ls')]",  # not a plain name
        "[send_mail(to='a@b.c')]",  # not a known tool
        "[get_weather(city='Paris'), 42]",
        "[get_weather(city='Paris')] and more",
        "[1, 2, 3]",
        "[get_weather(city={1, 2})]",  # a set: no JSON form
    ],
)
def test_anything_but_a_list_of_literal_calls_to_known_tools_stays_text(text: str) -> None:
    assert run(list(text)) == (text, ())


def test_without_the_pythonic_dialect_a_python_list_stays_text() -> None:
    reader = ToolCallParser((), tool_names=TOOLS)
    text = '[get_weather(city="Paris")]'

    assert reader.push(text) == "" and reader.finish() == (text, ())
