"""The closing tracker: a schema's shortest valid value, and the shortest text that completes a
JSON prefix into a valid value (written as the grammar writes JSON: `", "` and `": "`)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from modelhost.text.json_prefix import JsonPrefix
from modelhost.text.json_shape import ShapeUnsupported, choice_shape, shape_of

TRIP = {
    "type": "object",
    "properties": {
        "destinations": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "nights": {"type": "integer"}},
                "required": ["city", "nights"],
            },
        },
        "notes": {"type": "string"},
    },
    "required": ["destinations", "notes"],
}
BOUNDED = {
    "type": "object",
    "properties": {
        "code": {"type": "integer", "minimum": 10, "maximum": 99},
        "below": {"type": "integer", "maximum": -7},
        "word": {"type": "string", "minLength": 3},
        "pair": {"type": "array", "items": {"type": "number"}, "minItems": 2},
        "mode": {"enum": ["fast", "slow"]},
        "maybe": {"type": "boolean"},
    },
    "required": ["code", "below", "word", "pair", "mode"],
}
TREE = {
    "$defs": {
        "node": {
            "type": "object",
            "properties": {"v": {"type": "integer"}, "kids": {"items": {"$ref": "#/$defs/node"}}},
            "required": ["v"],
        }
    },
    "$ref": "#/$defs/node",
}


def completed(schema: Any, prefix: str) -> str:
    state = JsonPrefix.start(shape_of(schema)).feed(prefix.encode())
    assert state is not None, f"{prefix!r} left the schema"
    close = state.completion()
    assert close is not None
    return prefix + close.decode()


@pytest.mark.parametrize(
    ("schema", "shortest"),
    [
        (TRIP, '{"destinations": [], "notes": ""}'),
        (BOUNDED, '{"code": 10, "below": -7, "word": "aaa", "pair": [0, 0], "mode": "fast"}'),
        (TREE, '{"v": 0}'),
        ({"type": "object"}, "{}"),
        ({"type": ["null", "integer"]}, "0"),
        ({"anyOf": [{"const": "long-name"}, {"type": "boolean"}]}, "true"),
    ],
    ids=["trip", "bounded", "recursive", "free-object", "type-list", "any-of"],
)
def test_the_shortest_value_of_a_schema_is_valid_and_as_short_as_it_gets(
    schema: Any, shortest: str
) -> None:
    text = (shape_of(schema).shortest() or b"").decode()
    assert text == shortest
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize(
    ("prefix", "whole"),
    [
        (
            '{"destinations": [{"city": "Par',
            '{"destinations": [{"city": "Par", "nights": 0}], "notes": ""}',
        ),
        ('{"destinations": [{"ci', '{"destinations": [{"city": "", "nights": 0}], "notes": ""}'),
        ('{"destinations": [{"city": "A", "nights": 12', None),
        ('{"destinations": [], "notes": "so \\', '{"destinations": [], "notes": "so \\n"}'),
        ('{"destinations": [], "notes": "\\u00', '{"destinations": [], "notes": "\\u0000"}'),
        (
            '{"destinations": [{"city": "A", "nights": 1},',
            '{"destinations": [{"city": "A", "nights": 1}, {"city": "", "nights": 0}], '
            '"notes": ""}',
        ),
        ('{"destinations": [{"city": "A", "nights": 1}, ', None),
        ('{"destinations": [{"city": "A", "nights": -', None),
    ],
)
def test_an_open_prefix_completes_to_a_valid_value(prefix: str, whole: str | None) -> None:
    text = completed(TRIP, prefix)
    if whole is not None:
        assert text == whole
    jsonschema.validate(json.loads(text), TRIP)


@pytest.mark.parametrize(
    "prefix",
    [
        '{"code": 1',
        '{"code": 15, "below": -',
        '{"code": 15, "below": -1',
        '{"code": 15, "below": -9, "word": "a',
        '{"code": 15, "below": -9, "word": "abcd", "pair": [1.',
        '{"code": 15, "below": -9, "word": "abcd", "pair": [1e',
        '{"code": 15, "below": -9, "word": "abcd", "pair": [1, 2, 3], "mode": "sl',
        '{"code": 15, "below": -9, "word": "abcd", "pair": [1, 2], "mode": "fast", "ma',
    ],
)
def test_bounds_lengths_and_enums_hold_in_the_completion(prefix: str) -> None:
    jsonschema.validate(json.loads(completed(BOUNDED, prefix)), BOUNDED)


def test_a_completion_finishes_a_character_split_across_tokens() -> None:
    state = JsonPrefix.start(shape_of(TRIP)).feed(b'{"destinations": [], "notes": "caf')
    assert state is not None
    state = state.feed("é".encode()[:1])
    assert state is not None
    close = state.completion()
    assert close is not None
    text = (b'{"destinations": [], "notes": "caf' + "é".encode()[:1] + close).decode()
    jsonschema.validate(json.loads(text), TRIP)


def test_a_recursive_schema_closes_every_open_level() -> None:
    text = completed(TREE, '{"v": 1, "kids": [{"v": 2, "kids": [{"v')
    assert text == '{"v": 1, "kids": [{"v": 2, "kids": [{"v": 0}]}]}'


def test_a_free_object_closes_an_open_key_with_any_value() -> None:
    assert completed({"type": "object"}, '{"a": [1, {"b') == '{"a": [1, {"b": 0}]}'


def test_a_tool_call_union_follows_the_tool_named_so_far() -> None:
    def call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        return {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": arguments},
            "required": ["name", "arguments"],
        }

    weather = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    clock = {"type": "object", "properties": {"zone": {"enum": ["utc"]}}, "required": ["zone"]}
    schema = {"anyOf": [call("get_weather", weather), call("get_time", clock)]}
    assert (
        completed(schema, '{"name": "get_t') == '{"name": "get_time", "arguments": {"zone": "utc"}}'
    )
    assert (
        completed(schema, '{"name": "get_w') == '{"name": "get_weather", "arguments": {"city": ""}}'
    )


def test_a_choice_completes_to_the_shortest_choice_that_fits_the_prefix() -> None:
    state = JsonPrefix.start(choice_shape(("yes", "no", "never"))).feed(b"n")
    assert state is not None and state.completion() == b"o"
    state = state.feed(b"e")
    assert state is not None and state.completion() == b"ver"


def test_bytes_that_leave_the_schema_are_refused() -> None:
    start = JsonPrefix.start(shape_of(TRIP))
    assert start.feed(b'{"nights"') is None
    assert start.feed(b"[") is None
    assert start.feed(b'{"destinations": [], "notes": ""}x') is None


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "pattern": "^a+$"},
        {"type": "string", "format": "date"},
        {"not": {"type": "null"}},
        {"type": "array", "items": {"type": "integer"}, "minItems": 2, "uniqueItems": True},
    ],
    ids=["pattern", "format", "not", "unique-items"],
)
def test_a_schema_whose_shortest_value_is_unknown_is_refused(schema: Any) -> None:
    with pytest.raises(ShapeUnsupported):
        shape_of(schema)
