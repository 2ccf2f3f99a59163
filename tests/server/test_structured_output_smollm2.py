"""End to end: structured output enforced by grammars, through the `openai` SDK, over SmolLM2.

The 135M model rarely writes valid JSON on its own; every answer here must parse and validate
anyway, at temperature 1.0, because the sampler masks what the grammar forbids. Schemas bound
their strings and numbers so that answers fit in a short max_tokens.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from modelhost.cli_serve import build_serving
from modelhost.models.loaded import LoadedModel
from modelhost.server.app import ServeSettings

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "Describe a person as JSON."}]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "happy": {"type": "boolean"},
    },
    "required": ["name", "age", "happy"],
    "additionalProperties": False,
}
TAGS = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "sizes": {"type": "array", "items": {"type": "integer", "maximum": 99}, "maxItems": 3},
    },
    "required": ["colour", "sizes"],
    "additionalProperties": False,
}


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def is_person(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and set(value) == {"name", "age", "happy"}
        and isinstance(value["name"], str)
        and len(value["name"]) <= 12
        and type(value["age"]) is int
        and 0 <= value["age"] <= 120
        and isinstance(value["happy"], bool)
    )


def is_tags(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and set(value) == {"colour", "sizes"}
        and value["colour"] in ("red", "green", "blue")
        and isinstance(value["sizes"], list)
        and len(value["sizes"]) <= 3
        and all(type(size) is int and size <= 99 for size in value["sizes"])
    )


@pytest.fixture(scope="module")
def server(smollm2: LoadedModel, module_live_server: Any) -> Any:
    app = build_serving(smollm2, ServeSettings(), batch=4, max_queue=8)
    return module_live_server(app)


@pytest.fixture
def client(server: Any) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120
    ) as client:
        yield client


@pytest.mark.parametrize(("schema", "valid"), [(PERSON, is_person), (TAGS, is_tags)])
@pytest.mark.parametrize("seed", [1, 2])
def test_json_schema_answers_parse_and_validate_even_at_temperature_one(
    client: openai.OpenAI, schema: dict[str, Any], valid: Any, seed: int
) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="smollm2",
        messages=ASK,
        response_format=schema_format(schema),
        temperature=1.0,
        seed=seed,
        max_tokens=64,
    )
    answer = raw.parse()
    assert "warning" not in raw.headers
    assert answer.choices[0].finish_reason == "stop"
    assert valid(json.loads(answer.choices[0].message.content or ""))


def test_streamed_json_schema_answer_parses_and_validates(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="smollm2",
        messages=ASK,
        response_format=schema_format(PERSON),
        temperature=1.0,
        seed=5,
        max_tokens=64,
        stream=True,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert is_person(json.loads(text))


def test_guided_choice_answers_with_exactly_one_of_the_choices(client: openai.OpenAI) -> None:
    choices = ["Paris", "London", "Berlin"]
    answer = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=1.0,
        max_tokens=16,
        extra_body={"guided_choice": choices},
    )
    assert answer.choices[0].message.content in choices


def test_guided_regex_on_text_completions_matches_the_whole_answer(
    client: openai.OpenAI,
) -> None:
    answer = client.completions.create(
        model="smollm2",
        prompt="My phone number is",
        temperature=1.0,
        max_tokens=16,
        extra_body={"guided_regex": r"[0-9]{3}-[0-9]{4}"},
    )
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", answer.choices[0].text)


def test_a_schema_that_fails_to_compile_is_a_200_with_a_warning_header(
    client: openai.OpenAI,
) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="smollm2",
        messages=ASK,
        response_format=schema_format({"type": "bogus"}),
        max_tokens=8,
    )
    assert raw.status_code == 200
    assert raw.headers["warning"].startswith("grammar not enforced: ")
    assert raw.headers["warning"].endswith(" - falling back to prompt injection")
    assert "bogus" in raw.headers["warning"]


WEATHER_TOOL: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_a_forced_tool_choice_returns_a_call_whose_arguments_validate(
    client: openai.OpenAI, tool_choice: Any
) -> None:
    answer = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "What is the weather in Paris this week?"}],
        tools=[WEATHER_TOOL],
        tool_choice=tool_choice,
        temperature=1.0,
        seed=3,
        max_tokens=64,
    )
    choice = answer.choices[0]
    [call] = choice.message.tool_calls or []
    arguments = json.loads(call.function.arguments)  # type: ignore[union-attr]
    assert choice.finish_reason == "tool_calls"
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert set(arguments) == {"city", "days"} and isinstance(arguments["city"], str)
    assert len(arguments["city"]) <= 16 and 1 <= arguments["days"] <= 7
