"""End to end: structured output always closes. Whatever the budget, from the fewest tokens the
shortest valid answer takes up to 256, a schema-bound answer parses, validates and ends with
`stop` (`tool_calls`, `tool_use`) within max_tokens, on every surface (chat, Anthropic,
Responses, Ollama's `format`), plain and streamed; a budget below the shortest valid answer is a
400 in the surface's own shape, naming the minimum; whitespace between JSON tokens is bounded.

The schemas here are deliberately unbounded (free strings, arrays with no maxItems): SmolLM2
left alone writes into them until its budget runs out, which is what the closing must survive.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import ollama
import openai
import pytest

from modelhost.assembly import build_serving
from modelhost.models.loaded import LoadedModel
from modelhost.server.settings import ServeSettings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]  # 256-token answers on a busy CPU

DEFAULT_BUDGET = 40  # the server's --max-tokens: the bound of a request that sets none
TRIP_ASK = [{"role": "user", "content": "Plan a long trip through many European cities."}]
TRIP = {  # nested arrays of objects, free strings
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
CATALOG = {  # an enum, bounded integers, minItems, optional properties
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "rating": {"enum": ["low", "mid", "high"]},
        "items": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "count": {"type": "integer", "minimum": 1},
                    "tags": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["name", "count"],
            },
        },
        "comment": {"type": "string"},
    },
    "required": ["title", "rating", "items"],
}
REPORT = {  # a long string (minLength), an enum, a bounded integer, an optional property
    "type": "object",
    "properties": {
        "summary": {"type": "string", "minLength": 60},
        "severity": {"enum": ["minor", "major", "critical"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
        "owner": {"type": "string"},
    },
    "required": ["summary", "severity", "count"],
}
SCHEMAS = {"trip": TRIP, "catalog": CATALOG, "report": REPORT}
# (budget, temperature, seed): "min" is the fewest tokens the server says the shortest answer
# takes, "min+3" just above it; greedy and sampled with two seeds across the budgets.
CASES = pytest.mark.parametrize(
    ("budget", "temperature", "seed"),
    [
        ("min", 0.0, None),
        ("min", 0.8, 3),
        ("min+3", 0.8, 11),
        (128, 0.8, 11),
        (256, 0.8, 5),
    ],
    ids=["min-greedy", "min-s3", "min+3-s11", "128-s11", "256-s5"],
)


def schema_format(schema: dict[str, Any]) -> Any:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def validated(text: str, schema: dict[str, Any]) -> Any:
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


@pytest.fixture(scope="module")
def server(smollm2: LoadedModel, module_live_server: Any) -> Any:
    settings = ServeSettings(max_tokens=DEFAULT_BUDGET)
    return module_live_server(build_serving(smollm2, settings, batch=4, max_queue=8))


@pytest.fixture
def client(server: Any) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=600
    ) as client:
        yield client


@pytest.fixture
def claude(server: Any) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(
        base_url=server.base_url, api_key="unused", max_retries=0, timeout=600
    ) as client:
        yield client


_MINIMUMS: dict[str, int] = {}


def minimum(client: openai.OpenAI, name: str) -> int:
    """The fewest tokens the shortest valid answer takes, as the 400 for max_tokens=1 says."""
    if name not in _MINIMUMS:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model="smollm2",
                messages=TRIP_ASK,  # type: ignore[arg-type]
                response_format=schema_format(SCHEMAS[name]),
                max_tokens=1,
            )
        found = re.search(r"at least (\d+)", str(caught.value.body))
        assert found is not None
        _MINIMUMS[name] = int(found.group(1))
    return _MINIMUMS[name]


def budget_of(client: openai.OpenAI, name: str, budget: int | str) -> int:
    if budget == "min":
        return minimum(client, name)
    if budget == "min+3":
        return minimum(client, name) + 3
    assert isinstance(budget, int)
    return budget


@pytest.mark.parametrize("name", ["trip", "catalog", "report"])
@CASES
def test_a_chat_answer_validates_and_stops_within_any_budget(
    client: openai.OpenAI, name: str, budget: int | str, temperature: float, seed: int | None
) -> None:
    max_tokens = budget_of(client, name, budget)
    answer = client.chat.completions.create(
        model="smollm2",
        messages=TRIP_ASK,  # type: ignore[arg-type]
        response_format=schema_format(SCHEMAS[name]),
        max_tokens=max_tokens,
        temperature=temperature,
        seed=seed,
    )
    assert answer.choices[0].finish_reason == "stop"
    assert answer.usage is not None and answer.usage.completion_tokens <= max_tokens
    validated(answer.choices[0].message.content or "", SCHEMAS[name])


@pytest.mark.parametrize("name", ["trip", "catalog", "report"])
@pytest.mark.parametrize("budget", ["min", 64])
def test_a_streamed_chat_answer_validates_and_stops_within_its_budget(
    client: openai.OpenAI, name: str, budget: int | str
) -> None:
    max_tokens = budget_of(client, name, budget)
    stream = client.chat.completions.create(
        model="smollm2",
        messages=TRIP_ASK,  # type: ignore[arg-type]
        response_format=schema_format(SCHEMAS[name]),
        max_tokens=max_tokens,
        temperature=0.8,
        seed=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    [finish] = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    [usage] = [chunk.usage for chunk in chunks if chunk.usage is not None]
    assert finish == "stop" and usage.completion_tokens <= max_tokens
    validated(text, SCHEMAS[name])


CATALOG_TOOL = {"name": "save_catalog", "description": "Save a catalog", "input_schema": CATALOG}


@pytest.mark.parametrize(
    ("budget", "tool_choice", "stream"),
    [
        ("min", {"type": "any"}, False),
        ("min", {"type": "tool", "name": "save_catalog"}, True),
        (48, {"type": "tool", "name": "save_catalog"}, False),
        (128, {"type": "any"}, True),
    ],
    ids=["min-any-plain", "min-tool-streamed", "48-tool-plain", "128-any-streamed"],
)
def test_an_anthropic_forced_tool_use_validates_and_stops_within_any_budget(
    claude: anthropic.Anthropic, budget: int | str, tool_choice: Any, stream: bool
) -> None:
    # The forced call wraps the input ({"name": ..., "arguments": ...}): its minimum is a few
    # tokens more than the bare schema's, as the tool's own 400 says.
    max_tokens = anthropic_minimum(claude) if budget == "min" else int(budget)
    request: Any = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": "Save a catalog of fruit."}],
        "tools": [CATALOG_TOOL],
        "tool_choice": tool_choice,
        "max_tokens": max_tokens,
        "extra_body": {"temperature": 0.8, "seed": 3},
    }
    if stream:
        with claude.messages.stream(**request) as events:
            message = events.get_final_message()
    else:
        message = claude.messages.create(**request)
    [block] = [block for block in message.content if block.type == "tool_use"]
    assert message.stop_reason == "tool_use"
    assert message.usage.output_tokens <= max_tokens
    jsonschema.validate(block.input, CATALOG)


@pytest.mark.parametrize("budget", ["min", 96])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_an_anthropic_output_format_answer_validates_and_ends_within_any_budget(
    client: openai.OpenAI, claude: anthropic.Anthropic, budget: int | str, stream: bool
) -> None:
    max_tokens = budget_of(client, "report", budget)
    request: Any = {
        "model": "smollm2",
        "messages": TRIP_ASK,
        "max_tokens": max_tokens,
        "extra_body": {
            "output_config": {"format": {"type": "json_schema", "schema": REPORT}},
            "temperature": 0.8,
            "seed": 7,
        },
    }
    if stream:
        with claude.messages.stream(**request) as events:
            message = events.get_final_message()
    else:
        message = claude.messages.create(**request)
    assert message.stop_reason == "end_turn"
    assert message.usage.output_tokens <= max_tokens
    text = "".join(block.text for block in message.content if block.type == "text")
    validated(text, REPORT)


def anthropic_minimum(claude: anthropic.Anthropic) -> int:
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(
            model="smollm2",
            messages=[{"role": "user", "content": "Save a catalog of fruit."}],
            tools=[CATALOG_TOOL],  # type: ignore[list-item]
            tool_choice={"type": "any"},
            max_tokens=1,
        )
    found = re.search(r"at least (\d+)", str(caught.value.body))
    assert found is not None
    return int(found.group(1))


@pytest.mark.parametrize("budget", ["min", 48, 128])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_responses_answer_validates_and_completes_within_any_budget(
    client: openai.OpenAI, budget: int | str, stream: bool
) -> None:
    max_tokens = budget_of(client, "trip", budget)
    request: Any = {
        "model": "smollm2",
        "input": "Plan a long trip through many European cities.",
        "text": {"format": {"type": "json_schema", "name": "trip", "schema": TRIP}},
        "max_output_tokens": max_tokens,
        "temperature": 0.8,
        "extra_body": {"seed": 11},
    }
    if stream:
        events = list(client.responses.create(**request, stream=True))
        response = next(e.response for e in events if e.type == "response.completed")
    else:
        response = client.responses.create(**request)
    assert response.status == "completed"
    assert response.usage is not None and response.usage.output_tokens <= max_tokens
    validated(response.output_text, TRIP)


def test_a_streamed_responses_forced_call_at_its_minimum_validates_and_completes(
    client: openai.OpenAI,
) -> None:
    tool: Any = {"type": "function", "name": "save_catalog", "parameters": CATALOG}
    request: Any = {
        "model": "smollm2",
        "input": "Save a catalog of every fruit you know.",
        "tools": [tool],
        "tool_choice": "required",
    }
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(**request, max_output_tokens=1)
    found = re.search(r"at least (\d+)", str(caught.value.body))
    assert found is not None
    max_tokens = int(found.group(1))

    events = list(
        client.responses.create(
            **request,
            max_output_tokens=max_tokens,
            temperature=0.8,
            extra_body={"seed": 5},
            stream=True,
        )
    )

    response = next(e.response for e in events if e.type == "response.completed")
    assert response.status == "completed"
    assert response.usage is not None and response.usage.output_tokens <= max_tokens
    [call] = [item for item in response.output if item.type == "function_call"]
    assert call.name == "save_catalog"
    jsonschema.validate(json.loads(call.arguments), CATALOG)


def test_decisions_answer_only_with_the_labels_they_offer(server: Any) -> None:
    # A decision reads one token out of the offered labels: its answer cannot be anything else
    # and cannot run past a budget.
    questions = [
        {"type": "predicate", "name": "long", "instructions": "Is the trip long?"},
        {
            "type": "choice",
            "name": "first",
            "instructions": "Which city comes first?",
            "choices": [{"value": city} for city in ("Paris", "Rome", "Vienna", "Prague")],
        },
        {
            "type": "score",
            "name": "cost",
            "instructions": "How expensive is it?",
            "levels": [{"label": "cheap"}, {"label": "fair"}, {"label": "dear"}],
        },
    ]
    body = {"model": "smollm2", "input": TRIP_ASK[0]["content"], "questions": questions}

    response = httpx.post(f"{server.base_url}/v1/decisions", json=body, timeout=600)

    assert response.status_code == 200, response.text
    predicate, choice, score = response.json()["answers"]
    assert 0.0 <= predicate["probability"] <= 1.0
    assert choice["choice"] in ("Paris", "Rome", "Vienna", "Prague")
    assert 0.0 <= score["score"] <= 2.0


@pytest.mark.parametrize(
    ("max_tokens", "stream"), [(2, False), (24, True)], ids=["2-plain", "24-streamed"]
)
def test_a_json_object_answer_parses_and_stops_within_its_budget(
    client: openai.OpenAI, max_tokens: int, stream: bool
) -> None:
    request: Any = {
        "model": "smollm2",
        "messages": TRIP_ASK,
        "response_format": {"type": "json_object"},
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "seed": 3,
    }
    if stream:
        chunks = list(
            client.chat.completions.create(
                **request, stream=True, stream_options={"include_usage": True}
            )
        )
        text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
        [finish] = [
            c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
        ]
        [usage] = [chunk.usage for chunk in chunks if chunk.usage is not None]
    else:
        answer = client.chat.completions.create(**request)
        text = answer.choices[0].message.content or ""
        finish, usage = answer.choices[0].finish_reason, answer.usage
    assert finish == "stop"
    assert usage is not None and usage.completion_tokens <= max_tokens
    assert isinstance(json.loads(text), dict)


def test_whitespace_between_json_tokens_is_bounded_even_when_the_model_wants_nothing_else(
    client: openai.OpenAI, smollm2: LoadedModel
) -> None:
    # Every whitespace token SmolLM2 has, pushed to the top: a grammar that let whitespace
    # through would get an answer of newlines and indentation until the budget ran out.
    vocabulary = smollm2.tokenizer.backend.get_vocab()
    blanks = [i for piece, i in vocabulary.items() if piece.strip("ĠĊĉ\t ") == ""][:300]
    answer = client.chat.completions.create(
        model="smollm2",
        messages=TRIP_ASK,  # type: ignore[arg-type]
        response_format=schema_format(CATALOG),
        max_tokens=40,
        logit_bias={str(i): 100 for i in blanks},  # type: ignore[misc]
        temperature=0.8,
        seed=3,
    )
    text = answer.choices[0].message.content or ""
    assert answer.choices[0].finish_reason == "stop"
    validated(text, CATALOG)
    outside_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
    assert "\n" not in outside_strings and "  " not in outside_strings, text


def test_a_forced_tool_call_without_max_tokens_ends_within_the_server_default(
    client: openai.OpenAI,
) -> None:
    tool: Any = {
        "type": "function",
        "function": {"name": "save_catalog", "parameters": CATALOG},
    }
    answer = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Save a catalog of every fruit you know."}],
        tools=[tool],
        tool_choice="required",
        temperature=0.8,
        seed=3,
    )
    choice = answer.choices[0]
    [call] = choice.message.tool_calls or []
    assert choice.finish_reason == "tool_calls"
    assert answer.usage is not None and answer.usage.completion_tokens <= DEFAULT_BUDGET
    jsonschema.validate(json.loads(call.function.arguments), CATALOG)  # type: ignore[union-attr]


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_chat_budget_below_the_shortest_answer_is_a_400_naming_the_minimum(
    client: openai.OpenAI, field: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="smollm2",
            messages=TRIP_ASK,  # type: ignore[arg-type]
            response_format=schema_format(TRIP),
            stream=True,
            **{field: 3},  # type: ignore[arg-type]
        )
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == field
    assert error["code"] == "max_tokens_too_small"
    assert re.fullmatch(
        rf"{field} is 3 but the shortest answer that satisfies response_format\.json_schema "
        rf"takes \d+ tokens; set {field} to at least \d+",
        error["message"],
    )


def test_an_anthropic_budget_below_the_shortest_answer_is_an_anthropic_400(
    claude: anthropic.Anthropic,
) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(
            model="smollm2",
            messages=TRIP_ASK,  # type: ignore[arg-type]
            max_tokens=2,
            extra_body={"output_config": {"format": {"type": "json_schema", "schema": TRIP}}},
        )
    body = caught.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert "max_tokens is 2 but the shortest answer" in body["error"]["message"]


def test_a_responses_budget_below_the_shortest_answer_names_max_output_tokens(
    client: openai.OpenAI,
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(
            model="smollm2",
            input="Plan a trip.",
            text={"format": {"type": "json_schema", "name": "trip", "schema": TRIP}},
            max_output_tokens=2,
        )
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == "max_output_tokens"
    assert "set max_output_tokens to at least" in error["message"]


# ---------------------------------------------------------------------------------------------
# Ollama's `format`


OLLAMA_MODEL = "smollm2-135m-instruct"  # Ollama's routes know a model by its own name


@pytest.fixture
def llama(server: Any) -> Iterator[ollama.Client]:
    with ollama.Client(host=server.base_url, timeout=600) as client:
        yield client


@pytest.mark.parametrize(
    ("name", "budget", "stream"),
    [("catalog", "min", False), ("trip", "min+3", True), ("trip", None, True)],
    ids=["catalog-min-plain", "trip-min+3-streamed", "trip-no-num_predict-streamed"],
)
def test_an_ollama_format_answer_validates_and_stops_within_its_budget(
    client: openai.OpenAI, llama: ollama.Client, name: str, budget: str | None, stream: bool
) -> None:
    # Without num_predict the bound is the server's --max-tokens (DEFAULT_BUDGET here).
    max_tokens = DEFAULT_BUDGET if budget is None else budget_of(client, name, budget)
    options: dict[str, Any] = {"temperature": 0.8, "seed": 5}
    if budget is not None:
        options["num_predict"] = max_tokens
    if stream:
        parts = list(
            llama.chat(
                model=OLLAMA_MODEL,
                messages=TRIP_ASK,
                format=SCHEMAS[name],
                options=options,
                stream=True,
            )
        )
        text = "".join(part.message.content for part in parts)
        last = parts[-1]
    else:
        last = llama.chat(
            model=OLLAMA_MODEL, messages=TRIP_ASK, format=SCHEMAS[name], options=options
        )
        text = last.message.content or ""
    assert last.done and last.done_reason == "stop"
    assert last.eval_count is not None and last.eval_count <= max_tokens
    validated(text, SCHEMAS[name])


def test_an_ollama_json_format_generate_streams_an_object_within_a_tiny_budget(
    llama: ollama.Client,
) -> None:
    parts = list(
        llama.generate(
            model=OLLAMA_MODEL,
            prompt="Plan a trip as JSON.",
            format="json",
            options={"num_predict": 2, "temperature": 0.8, "seed": 3},
            stream=True,
        )
    )
    assert parts[-1].done_reason == "stop"
    assert parts[-1].eval_count is not None and parts[-1].eval_count <= 2
    assert isinstance(json.loads("".join(part.response for part in parts)), dict)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_an_ollama_budget_below_the_shortest_answer_is_an_ollama_400_naming_num_predict(
    server: Any, stream: bool
) -> None:
    body = {
        "model": OLLAMA_MODEL,
        "messages": TRIP_ASK,
        "format": TRIP,
        "options": {"num_predict": 3},
        "stream": stream,
    }

    response = httpx.post(f"{server.base_url}/api/chat", json=body, timeout=600)

    assert response.status_code == 400
    error = response.json()
    assert set(error) == {"error"}
    assert re.fullmatch(
        r"num_predict is 3 but the shortest answer that satisfies format takes \d+ tokens; "
        r"set num_predict to at least \d+",
        error["error"],
    )
