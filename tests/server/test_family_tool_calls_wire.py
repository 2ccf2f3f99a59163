"""Each family's own tool-call markup, as a scripted model of that family writes it, reaches
every surface as a parsed call (OpenAI tool_calls, Anthropic tool_use, Responses function_call),
streamed or not, with none of the markup in the text. A dialect a model's own template declares
(Llama 3.2's pythonic list) is keyed `architecture:template`."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import pytest
from family_templates import template
from scripted_engine import ScriptedEngine, scripted_model
from sse_payloads import sse_data
from starlette.applications import Starlette

AppFactory = Callable[..., Starlette]
ClientFactory = Callable[[Starlette], httpx.AsyncClient]

# family record → its markup, split across tokens as the model's tokenizer would write it
SCRIPTS = {
    "llama": ("<|python_tag|>", '{"name": "get_weather", ', '"parameters": {"city": "Paris"}}'),
    "mistral": ("Checking.", "[TOOL_CALLS]", "get_weather", "[ARGS]", '{"city": ', '"Paris"}'),
    "phi3": ("<|tool_call|>", '[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
             "<|/tool_call|>"),
    "granite": ("Checking.", "<|tool", "_call|>", '[{"name": "get_weather", ',
                '"arguments": {"city": "Paris"}}]'),
    "gemma2": ("```tool_code\n", 'get_weather(city="Paris")', "\n```"),
    "llama:llama3_2_pythonic": ("[get", "_weather(", 'city="Paris"', ")]"),
}  # fmt: skip
MARKUP = ("[TOOL_CALLS]", "[ARGS]", "<|tool_call|>", "<|/tool_call|>", "<|python_tag|>", "```",
          "(city=")  # fmt: skip
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}
USER = [{"role": "user", "content": "Weather in Paris?"}]


def app_for(make_app: AppFactory, family: str) -> Starlette:
    architecture, _, fixture = family.partition(":")
    model = scripted_model(family=architecture, template=template(fixture) if fixture else None)
    return make_app(ScriptedEngine(SCRIPTS[family]), model)


def clean(text: str | None) -> bool:
    return not any(marker in (text or "") for marker in MARKUP)


@pytest.mark.parametrize("family", sorted(SCRIPTS))
async def test_openai_chat_returns_the_familys_call_parsed(
    family: str, make_app: AppFactory, client_of: ClientFactory
) -> None:
    body = {"model": "m", "messages": USER, "tools": [WEATHER]}

    response = await client_of(app_for(make_app, family)).post("/v1/chat/completions", json=body)

    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert clean(choice["message"]["content"])


@pytest.mark.parametrize("family", sorted(SCRIPTS))
async def test_openai_chat_streams_the_familys_call_with_no_markup_in_the_deltas(
    family: str, make_app: AppFactory, client_of: ClientFactory
) -> None:
    body = {"model": "m", "messages": USER, "tools": [WEATHER], "stream": True}

    response = await client_of(app_for(make_app, family)).post("/v1/chat/completions", json=body)

    deltas = [chunk["choices"][0]["delta"] for chunk in sse_data(response.text)]
    assert all(clean(delta.get("content")) for delta in deltas)
    [[call]] = [delta["tool_calls"] for delta in deltas if "tool_calls" in delta]
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


@pytest.mark.parametrize("family", sorted(SCRIPTS))
async def test_anthropic_messages_answer_the_familys_call_as_a_tool_use_block(
    family: str, make_app: AppFactory, client_of: ClientFactory
) -> None:
    tool = {"name": "get_weather", "input_schema": PARAMETERS}
    body = {"model": "m", "max_tokens": 64, "messages": USER, "tools": [tool]}

    message = (await client_of(app_for(make_app, family)).post("/v1/messages", json=body)).json()

    uses = [block for block in message["content"] if block["type"] == "tool_use"]
    assert [(use["name"], use["input"]) for use in uses] == [("get_weather", {"city": "Paris"})]
    assert all(clean(block.get("text")) for block in message["content"])
    assert message["stop_reason"] == "tool_use"


@pytest.mark.parametrize("family", sorted(SCRIPTS))
async def test_responses_output_the_familys_call_as_a_function_call_item(
    family: str, make_app: AppFactory, client_of: ClientFactory
) -> None:
    tool = {"type": "function", "name": "get_weather", "parameters": PARAMETERS}
    body = {"model": "m", "input": "Weather in Paris?", "tools": [tool], "stream": True}

    response = await client_of(app_for(make_app, family)).post("/v1/responses", json=body)

    output = sse_data(response.text)[-1]["response"]["output"]
    calls = [item for item in output if item["type"] == "function_call"]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    texts = [part["text"] for item in output for part in item.get("content") or []]
    assert all(clean(text) for text in texts)
