"""Tool calls and reasoning on every surface, over a scripted Qwen3-family model whose script
writes `<think>` and `<tool_call>` markup: the wire shapes, and that markup never leaks."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from scripted_engine import ScriptedEngine, scripted_model
from sse_payloads import sse_data
from starlette.applications import Starlette

AppFactory = Callable[..., Starlette]
ClientFactory = Callable[[Starlette], httpx.AsyncClient]

# The markup arrives split across tokens, as a real tokenizer would split it.
CALL_SCRIPT = (
    "<thi", "nk>", "Weather needs", " a tool.", "</th", "ink>\n\n", "Checking.", "<tool", "_call>",
    '\n{"name": "get_weather", ', '"arguments": {"city": "Paris"}}', "\n</tool_", "call>",
)  # fmt: skip
THINK_SCRIPT = ("<think>", "Say hi.", "</think>", "\n\nHello", "!")
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
ANTHROPIC_WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": WEATHER["function"]["parameters"],  # type: ignore[index]
}
USER = [{"role": "user", "content": "Weather in Paris?"}]


def qwen_app(make_app: AppFactory, script: tuple[str, ...]) -> tuple[Starlette, ScriptedEngine]:
    engine = ScriptedEngine(script)
    return make_app(engine, scripted_model(family="qwen3")), engine


# ---- OpenAI chat ------------------------------------------------------------------------------


async def test_chat_returns_parsed_tool_calls_with_null_content_and_the_reasoning(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    app, _ = qwen_app(make_app, CALL_SCRIPT)
    body = {"model": "m", "messages": USER, "tools": [WEATHER]}

    choice = (await client_of(app).post("/v1/chat/completions", json=body)).json()["choices"][0]

    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Checking."
    assert choice["message"]["reasoning"] == "Weather needs a tool."
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


async def test_chat_streams_reasoning_then_content_then_all_calls_in_one_chunk(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    app, _ = qwen_app(make_app, CALL_SCRIPT)
    body = {"model": "m", "messages": USER, "tools": [WEATHER], "stream": True}

    response = await client_of(app).post("/v1/chat/completions", json=body)

    deltas = [chunk["choices"][0]["delta"] for chunk in sse_data(response.text)]
    reasoning = "".join(delta.get("reasoning", "") for delta in deltas)
    content = "".join(delta.get("content") or "" for delta in deltas)
    calls = [delta["tool_calls"] for delta in deltas if "tool_calls" in delta]
    assert (reasoning, content) == ("Weather needs a tool.", "Checking.")
    assert len(calls) == 1 and calls[0][0]["index"] == 0
    assert calls[0][0]["function"]["name"] == "get_weather"
    assert sse_data(response.text)[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_chat_without_tools_leaves_tool_markup_in_the_content(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    app, _ = qwen_app(make_app, CALL_SCRIPT)
    body = {"model": "m", "messages": USER}

    choice = (await client_of(app).post("/v1/chat/completions", json=body)).json()["choices"][0]

    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"].startswith("Checking.<tool_call>")


async def test_chat_with_thinking_disabled_does_not_split_reasoning(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    app, _ = qwen_app(make_app, THINK_SCRIPT)
    body = {"model": "m", "messages": USER, "chat_template_kwargs": {"enable_thinking": False}}

    message = (await client_of(app).post("/v1/chat/completions", json=body)).json()["choices"][0]

    assert "reasoning" not in message["message"]
    assert message["message"]["content"] == "<think>Say hi.</think>\n\nHello!"


# ---- Anthropic Messages -----------------------------------------------------------------------


async def test_anthropic_answers_thinking_text_and_tool_use_blocks_in_order(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    app, _ = qwen_app(make_app, CALL_SCRIPT)
    body = {"model": "m", "max_tokens": 64, "messages": USER, "tools": [ANTHROPIC_WEATHER]}

    message = (await client_of(app).post("/v1/messages", json=body)).json()

    assert [block["type"] for block in message["content"]] == ["thinking", "text", "tool_use"]
    assert message["content"][0] == {
        "type": "thinking",
        "thinking": "Weather needs a tool.",
        "signature": "",
    }
    assert message["content"][2]["input"] == {"city": "Paris"}
    assert message["stop_reason"] == "tool_use"


async def test_anthropic_streams_the_thinking_block_before_the_text_and_tool_blocks(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    app, _ = qwen_app(make_app, CALL_SCRIPT)
    body = {
        "model": "m",
        "max_tokens": 64,
        "messages": USER,
        "tools": [ANTHROPIC_WEATHER],
        "stream": True,
    }

    events = sse_data((await client_of(app).post("/v1/messages", json=body)).text)

    starts = [(e["index"], e["content_block"]["type"]) for e in events if "content_block" in e]
    assert starts == [(0, "thinking"), (1, "text"), (2, "tool_use")]
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert {"type": "signature_delta", "signature": ""} in deltas
    partial = [d["partial_json"] for d in deltas if d["type"] == "input_json_delta"]
    assert [json.loads(text) for text in partial] == [{"city": "Paris"}]
    stop = next(e for e in events if e["type"] == "message_delta")
    assert stop["delta"]["stop_reason"] == "tool_use"


# ---- OpenAI Responses -------------------------------------------------------------------------


async def test_responses_output_reasoning_message_and_function_call_items(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    app, _ = qwen_app(make_app, CALL_SCRIPT)
    tool = {"type": "function", **WEATHER["function"]}  # type: ignore[dict-item]
    body = {"model": "m", "input": "Weather in Paris?", "tools": [tool]}

    output = (await client_of(app).post("/v1/responses", json=body)).json()["output"]

    assert [item["type"] for item in output] == ["reasoning", "message", "function_call"]
    assert output[0]["summary"] == [{"type": "summary_text", "text": "Weather needs a tool."}]
    assert output[2]["name"] == "get_weather" and output[2]["call_id"].startswith("call_")
    assert json.loads(output[2]["arguments"]) == {"city": "Paris"}


async def test_responses_stream_the_items_in_the_order_of_the_final_output(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    app, _ = qwen_app(make_app, CALL_SCRIPT)
    tool = {"type": "function", **WEATHER["function"]}  # type: ignore[dict-item]
    body = {"model": "m", "input": "Weather in Paris?", "tools": [tool], "stream": True}

    events = sse_data((await client_of(app).post("/v1/responses", json=body)).text)

    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    final = events[-1]["response"]["output"]
    assert events[-1]["type"] == "response.completed"
    assert [item["type"] for item in done] == ["reasoning", "message", "function_call"]
    assert done == final
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


# ---- Forced tool choice and output formats ----------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "says_call"),
    [
        (
            "/v1/chat/completions",
            {"messages": USER, "tools": [WEATHER], "tool_choice": "required"},
            '"finish_reason":"tool_calls"',
        ),
        (
            "/v1/messages",
            {"max_tokens": 64, "messages": USER, "tools": [ANTHROPIC_WEATHER],
             "tool_choice": {"type": "tool", "name": "get_weather"}},
            '"stop_reason":"tool_use"',
        ),
        (
            "/v1/responses",
            {"input": "hi", "tools": [{"type": "function", **WEATHER["function"]}],  # type: ignore[dict-item]
             "tool_choice": {"type": "function", "name": "get_weather"}},
            '"type":"function_call"',
        ),
    ],
)  # fmt: skip
async def test_a_forced_tool_choice_is_enforced_by_a_grammar_and_returns_the_call(
    make_app: AppFactory,
    client_of: ClientFactory,
    path: str,
    body: dict[str, Any],
    says_call: str,
) -> None:
    script = ('{"name": "get_weather", ', '"arguments": {"city": "Paris"}}')
    app, engine = qwen_app(make_app, script)

    response = await client_of(app).post(path, json={"model": "m", **body})

    assert response.status_code == 200
    assert engine.submissions[-1].params.grammar is not None
    assert says_call in response.text


async def test_a_tool_choice_naming_an_unknown_tool_is_a_400(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    app, _ = qwen_app(make_app, CALL_SCRIPT)
    choice = {"type": "function", "function": {"name": "nope"}}
    body = {"model": "m", "messages": USER, "tools": [WEATHER], "tool_choice": choice}

    response = await client_of(app).post("/v1/chat/completions", json=body)

    assert response.status_code == 400
    assert "nope" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/messages", {"max_tokens": 8, "messages": USER, "output_config": {
            "format": {"type": "json_schema", "schema": {"type": "object"}}}}),
        ("/v1/responses", {"input": "hi", "text": {
            "format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}}),
    ],
)  # fmt: skip
async def test_an_output_format_is_enforced_by_a_grammar(
    make_app: AppFactory, client_of: ClientFactory, path: str, body: dict[str, Any]
) -> None:
    app, engine = qwen_app(make_app, ("{}",))

    response = await client_of(app).post(path, json={"model": "m", **body})

    assert response.status_code == 200
    assert engine.submissions[-1].params.grammar is not None
    assert "grammar not enforced" not in response.headers.get("warning", "")


async def test_the_model_list_reports_structured_output(client: httpx.AsyncClient) -> None:
    row = (await client.get("/v1/models")).json()["data"][0]

    assert row["structured_output"] is True
    assert row["capabilities"]["structured_output"] is True
