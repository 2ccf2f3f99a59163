"""Which grammar an OpenAI body asks for, by the reference's precedence."""

from __future__ import annotations

from typing import Any

import pytest

from modelhost.inference.contracts import GrammarSpec
from modelhost.server.openai import fields

SCHEMA = {"type": "object"}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
EVERYTHING = {
    "guided_grammar": 'root ::= "a"',
    "response_format": JSON_SCHEMA,
    "structured_outputs": {"regex": "b+"},
    "guided_regex": "c+",
    "guided_choice": ["d"],
}


def without(*names: str) -> dict[str, Any]:
    return {key: value for key, value in EVERYTHING.items() if key not in names}


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (EVERYTHING, GrammarSpec("grammar", 'root ::= "a"', field="guided_grammar")),
        (
            without("guided_grammar"),
            GrammarSpec("json_schema", '{"type": "object"}', field="response_format.json_schema"),
        ),
        (
            {**without("guided_grammar"), "response_format": {"type": "json_object"}},
            GrammarSpec("json_object", field="response_format"),
        ),
        (
            without("guided_grammar", "response_format"),
            GrammarSpec("regex", "b+", field="structured_outputs.regex"),
        ),
        (
            without("guided_grammar", "response_format", "structured_outputs"),
            GrammarSpec("regex", "c+", field="guided_regex"),
        ),
        (
            {"guided_choice": ["d", "e"]},
            GrammarSpec("choice", choices=("d", "e"), field="guided_choice"),
        ),
        (
            {"structured_outputs": {"json": SCHEMA}},
            GrammarSpec("json_schema", '{"type": "object"}', field="structured_outputs.json"),
        ),
        ({"response_format": {"type": "text"}}, None),
        ({}, None),
    ],
)
def test_the_grammar_follows_the_reference_precedence(
    body: dict[str, Any], expected: GrammarSpec | None
) -> None:
    grammar, _ = fields.structured_output(body)
    assert grammar == expected
