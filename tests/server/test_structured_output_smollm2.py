"""End to end: structured output enforced by grammars, through the official SDKs, over SmolLM2.

The 135M model rarely writes valid JSON on its own; every answer here must parse and validate
(`jsonschema`) anyway, at temperature 1.0, on every surface (chat `response_format`, Anthropic
`output_config.format`, Responses `text.format`), because the sampler masks what the grammar
forbids. Schemas bound their strings, numbers and arrays so that answers fit in a short budget.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

from modelhost.assembly import build_serving
from modelhost.models.loaded import LoadedModel
from modelhost.server.settings import ServeSettings

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "Describe a person as JSON."}]
BUDGET = 96

PERSON = {  # required keys, bounded integer and string, boolean
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "happy": {"type": "boolean"},
    },
    "required": ["name", "age", "happy"],
    "additionalProperties": False,
}
PET_OWNER = {  # a nested object
    "type": "object",
    "properties": {
        "owner": {"type": "string", "maxLength": 10},
        "pet": {
            "type": "object",
            "properties": {
                "kind": {"enum": ["cat", "dog", "fish"]},
                "legs": {"type": "integer", "minimum": 0, "maximum": 4},
            },
            "required": ["kind", "legs"],
            "additionalProperties": False,
        },
    },
    "required": ["owner", "pet"],
    "additionalProperties": False,
}
ORDER = {  # an array of objects
    "type": "object",
    "properties": {
        "lines": {
            "type": "array",
            "minItems": 1,
            "maxItems": 2,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "maxLength": 6},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                },
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["lines"],
    "additionalProperties": False,
}
TAGS = {  # an enum and an array of bounded integers
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "sizes": {
            "type": "array",
            "items": {"type": "integer", "minimum": -5, "maximum": 99},
            "maxItems": 3,
        },
    },
    "required": ["colour", "sizes"],
    "additionalProperties": False,
}
SCHEMAS = pytest.mark.parametrize(
    "schema", [PERSON, PET_OWNER, ORDER, TAGS], ids=["person", "nested", "array", "enum"]
)
SEEDS = pytest.mark.parametrize("seed", [1, 2])


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def validated(text: str, schema: dict[str, Any]) -> Any:
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


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


@pytest.fixture
def claude(server: Any) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(
        base_url=server.base_url, api_key="unused", max_retries=0, timeout=120
    ) as client:
        yield client


@SCHEMAS
@SEEDS
def test_chat_json_schema_answers_validate_even_at_temperature_one(
    client: openai.OpenAI, schema: dict[str, Any], seed: int
) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="smollm2",
        messages=ASK,
        response_format=schema_format(schema),  # type: ignore[arg-type]
        temperature=1.0,
        seed=seed,
        max_tokens=BUDGET,
    )
    answer = raw.parse()
    assert "warning" not in raw.headers
    assert answer.choices[0].finish_reason == "stop"
    validated(answer.choices[0].message.content or "", schema)


@SCHEMAS
@SEEDS
def test_anthropic_output_config_answers_validate_even_at_temperature_one(
    claude: anthropic.Anthropic, schema: dict[str, Any], seed: int
) -> None:
    message = claude.messages.create(
        model="smollm2",
        messages=ASK,  # type: ignore[arg-type]
        max_tokens=BUDGET,
        extra_body={  # current SDKs send sampling fields only through extra_body
            "output_config": {"format": {"type": "json_schema", "schema": schema}},
            "temperature": 1.0,
            "seed": seed,
        },
    )
    assert message.stop_reason == "end_turn"
    [block] = message.content
    assert block.type == "text"
    validated(block.text, schema)


@SCHEMAS
@SEEDS
def test_responses_text_format_answers_validate_even_at_temperature_one(
    client: openai.OpenAI, schema: dict[str, Any], seed: int
) -> None:
    response = client.responses.create(
        model="smollm2",
        input="Describe a person as JSON.",
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema}},
        temperature=1.0,
        max_output_tokens=BUDGET,
        extra_body={"seed": seed},
    )
    assert response.status == "completed"
    validated(response.output_text, schema)


def test_streamed_json_schema_answer_parses_and_validates(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="smollm2",
        messages=ASK,
        response_format=schema_format(PERSON),  # type: ignore[arg-type]
        temperature=1.0,
        seed=5,
        max_tokens=BUDGET,
        stream=True,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    validated(text, PERSON)


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


BOGUS = {"type": "bogus"}


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_schema_that_fails_to_compile_is_an_openai_400_naming_the_problem(
    client: openai.OpenAI, stream: bool
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="smollm2",
            messages=ASK,
            response_format=schema_format(BOGUS),  # type: ignore[arg-type]
            max_tokens=8,
            stream=stream,
        )
    error = caught.value.body
    assert isinstance(error, dict) and error["type"] == "invalid_request_error"
    assert error["param"] == "response_format"
    assert error["message"].startswith("response_format.json_schema is not a valid grammar: ")
    assert "bogus" in error["message"]


def test_an_anthropic_schema_that_fails_to_compile_is_an_anthropic_400_naming_the_problem(
    claude: anthropic.Anthropic,
) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(
            model="smollm2",
            messages=ASK,  # type: ignore[arg-type]
            max_tokens=8,
            extra_body={"output_config": {"format": {"type": "json_schema", "schema": BOGUS}}},
        )
    body = caught.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith("output_config.format.schema is not a valid grammar")
    assert "bogus" in body["error"]["message"]


def test_a_responses_schema_that_fails_to_compile_is_a_400_before_the_stream_opens(
    client: openai.OpenAI,
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(
            model="smollm2",
            input="hi",
            text={"format": {"type": "json_schema", "name": "answer", "schema": BOGUS}},
            max_output_tokens=8,
            stream=True,
        )
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == "text"
    assert error["message"].startswith("text.format.schema is not a valid grammar: ")


def test_an_unparseable_guided_regex_is_a_400_naming_the_field(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="guided_regex is not a valid grammar"):
        client.completions.create(
            model="smollm2", prompt="hi", max_tokens=8, extra_body={"guided_regex": "("}
        )


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
        max_tokens=BUDGET,
    )
    choice = answer.choices[0]
    [call] = choice.message.tool_calls or []
    arguments = json.loads(call.function.arguments)  # type: ignore[union-attr]
    assert choice.finish_reason == "tool_calls"
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert set(arguments) == {"city", "days"} and isinstance(arguments["city"], str)
    assert len(arguments["city"]) <= 16 and 1 <= arguments["days"] <= 7


def test_an_anthropic_forced_tool_returns_a_tool_use_whose_input_validates(
    claude: anthropic.Anthropic,
) -> None:
    function = WEATHER_TOOL["function"]
    message = claude.messages.create(
        model="smollm2",
        messages=[{"role": "user", "content": "What is the weather in Paris this week?"}],
        tools=[{"name": "get_weather", "input_schema": function["parameters"]}],
        tool_choice={"type": "tool", "name": "get_weather"},
        max_tokens=BUDGET,
        extra_body={"temperature": 1.0, "seed": 3},
    )
    [block] = [block for block in message.content if block.type == "tool_use"]
    assert message.stop_reason == "tool_use"
    assert block.name == "get_weather"
    jsonschema.validate(block.input, function["parameters"])


def test_a_responses_required_tool_choice_returns_a_function_call_that_validates(
    client: openai.OpenAI,
) -> None:
    function = WEATHER_TOOL["function"]
    response = client.responses.create(
        model="smollm2",
        input="What is the weather in Paris this week?",
        tools=[{"type": "function", "name": "get_weather", "parameters": function["parameters"]}],
        tool_choice="required",
        temperature=1.0,
        max_output_tokens=BUDGET,
        extra_body={"seed": 3},
    )
    [call] = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), function["parameters"])
