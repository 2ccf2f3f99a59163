"""A grammar-bound answer (a forced tool call, a JSON schema) is the value itself, even for a
family with reasoning tags and a template whose generation prompt opens a thinking block: the
model writes no reasoning under a grammar, so none of its text is taken for reasoning, and
tag-like text inside a JSON string stays where it was written."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
from scripted_engine import ScriptedEngine, scripted_model
from starlette.applications import Starlette

from modelhost.models.families import CHATML_TEMPLATE

AppFactory = Callable[..., Starlette]
ClientFactory = Callable[[Starlette], httpx.AsyncClient]

# ChatML whose generation prompt opens the thinking block (QwQ's and R1's templates do).
THINKING_TEMPLATE = CHATML_TEMPLATE.replace("assistant\\n' }}", "assistant\\n<think>\\n' }}")
CALL = ('{"name": "get_weather", ', '"arguments": {"city": "<think>Paris</think>"}}')
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}
USER = [{"role": "user", "content": "Weather in Paris?"}]


def thinking_app(make_app: AppFactory, script: tuple[str, ...]) -> Starlette:
    model = scripted_model(family="qwen3", template=THINKING_TEMPLATE)
    return make_app(ScriptedEngine(script), model)


async def test_the_template_really_opens_a_thinking_block(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    body = {"model": "m", "messages": USER}

    response = await client_of(thinking_app(make_app, ("plan", "</think>", "Sunny."))).post(
        "/v1/chat/completions", json=body
    )

    message = response.json()["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == ("plan", "Sunny.")


async def test_a_forced_call_is_a_call_not_reasoning_when_the_prompt_opened_thinking(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    body = {"model": "m", "messages": USER, "tools": [WEATHER], "tool_choice": "required"}

    response = await client_of(thinking_app(make_app, CALL)).post("/v1/chat/completions", json=body)

    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert "reasoning" not in choice["message"]
    [call] = choice["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "<think>Paris</think>"}


async def test_a_schema_bound_answer_keeps_tag_like_text_in_its_strings(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    schema = {"type": "object", "properties": {"note": {"type": "string"}}, "required": ["note"]}
    body = {
        "model": "m",
        "messages": USER,
        "stream": True,
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
    }
    script = ('{"note": "', "<think>", "kept", "</think>", '"}')

    response = await client_of(thinking_app(make_app, script)).post(
        "/v1/chat/completions", json=body
    )

    frames = [line.removeprefix("data: ") for line in response.text.split("\n")]
    chunks = [json.loads(f) for f in frames if f.startswith("{")]
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks if chunk["choices"]]
    assert not any(delta.get("reasoning") for delta in deltas)
    content = "".join(delta.get("content") or "" for delta in deltas)
    assert json.loads(content) == {"note": "<think>kept</think>"}
