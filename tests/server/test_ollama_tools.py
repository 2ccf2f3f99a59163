"""The official `ollama` client reads tool calls and thinking from a real server on a loopback
port, over a scripted Qwen3-family model that writes `<think>` and `<tool_call>` markup."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import ollama
import pytest
from scripted_engine import ScriptedEngine, scripted_model
from starlette.applications import Starlette

AppFactory = Callable[..., Starlette]
MODEL = "scripted-model"
SCRIPT = (
    "<think>", "Use the tool.", "</think>", "<tool_call>",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}', "</tool_call>",
)  # fmt: skip
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL: Any = {"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def start(make_app: AppFactory, live_server: Any, script: tuple[str, ...] = SCRIPT) -> Any:
    engine = ScriptedEngine(script)
    server = live_server(make_app(engine, scripted_model(family="qwen3")))
    return ollama.Client(host=server.base_url), engine, server.base_url


def test_chat_answers_tool_calls_with_arguments_as_an_object(
    make_app: AppFactory, live_server: Any
) -> None:
    client, _, _ = start(make_app, live_server)
    with client:
        reply = client.chat(model=MODEL, messages=ASK, tools=[TOOL], think=True)
    [call] = reply.message.tool_calls or []
    assert call.function.name == "get_weather"
    assert call.function.arguments == {"city": "Paris"}
    assert reply.message.thinking == "Use the tool."
    assert reply.message.content == ""
    assert reply.done and reply.done_reason == "stop"


def test_a_streamed_chat_carries_thinking_then_the_tool_calls(
    make_app: AppFactory, live_server: Any
) -> None:
    client, _, _ = start(make_app, live_server)
    with client:
        parts = list(client.chat(model=MODEL, messages=ASK, tools=[TOOL], think=True, stream=True))
    thinking = "".join(p.message.thinking or "" for p in parts)
    calls = [c for p in parts for c in p.message.tool_calls or []]
    assert thinking == "Use the tool."
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert parts[-1].done and not any(p.done for p in parts[:-1])


def test_a_tool_result_goes_back_into_the_next_prompt(
    make_app: AppFactory, live_server: Any
) -> None:
    client, engine, _ = start(make_app, live_server)
    with client:
        first = client.chat(model=MODEL, messages=ASK, tools=[TOOL])
        client.chat(
            model=MODEL,
            tools=[TOOL],
            messages=[
                *ASK,
                first.message,
                {"role": "tool", "content": "sunny, 21C", "tool_name": "get_weather"},
            ],
        )
    prompt = scripted_model().tokenizer.decode(engine.submissions[-1].prompt_ids, False)
    assert "<tool_response>\nsunny, 21C\n</tool_response>" in prompt  # built-in tool prompt


def test_show_of_a_reasoning_model_says_it_thinks(make_app: AppFactory, live_server: Any) -> None:
    client, _, _ = start(make_app, live_server)
    with client:
        shown = client.show(MODEL)
    assert shown.capabilities is not None
    assert {"completion", "tools", "thinking"} <= set(shown.capabilities)


def test_a_server_of_one_model_refuses_another_name_with_a_404(
    make_app: AppFactory, live_server: Any
) -> None:
    client, _, base_url = start(make_app, live_server)
    with client, pytest.raises(ollama.ResponseError) as raised:
        client.chat(model="llama3.2", messages=ASK)
    assert raised.value.status_code == 404 and "llama3.2" in raised.value.error
    streamed = httpx.post(
        f"{base_url}/api/chat", json={"model": f"{MODEL}:latest", "messages": ASK}
    )
    assert streamed.status_code == 200
    assert streamed.headers["content-type"].startswith("application/x-ndjson")


def test_the_api_key_applies_and_a_miss_is_a_401_in_ollamas_shape(
    make_app: AppFactory, live_server: Any
) -> None:
    server = live_server(make_app(ScriptedEngine(("Hi",)), api_key="sesame"))
    refused = httpx.post(f"{server.base_url}/api/chat", json={"model": MODEL, "messages": ASK})
    assert refused.status_code == 401 and set(refused.json()) == {"error"}
    with ollama.Client(host=server.base_url, headers={"Authorization": "Bearer sesame"}) as client:
        assert client.chat(model=MODEL, messages=ASK).message.content == "Hi"


def test_a_body_over_the_limit_is_a_413_in_ollamas_shape(
    make_app: AppFactory, live_server: Any
) -> None:
    server = live_server(make_app(ScriptedEngine(("Hi",)), max_body_bytes=1024))
    long = [{"role": "user", "content": "x" * 4096}]
    refused = httpx.post(f"{server.base_url}/api/chat", json={"model": MODEL, "messages": long})
    assert refused.status_code == 413 and set(refused.json()) == {"error"}


def test_a_cors_origin_opens_ollamas_routes_to_that_page(
    make_app: AppFactory, live_server: Any
) -> None:
    origin = "chrome-extension://page-assist"
    server = live_server(make_app(ScriptedEngine(("Hi",)), cors_origins=(origin,)))
    body = {"model": MODEL, "messages": ASK, "stream": False}
    allowed = httpx.post(f"{server.base_url}/api/chat", json=body, headers={"origin": origin})
    assert allowed.status_code == 200 and allowed.json()["message"]["content"] == "Hi"
    other = httpx.post(
        f"{server.base_url}/api/chat", json=body, headers={"origin": "https://evil.example"}
    )
    assert other.status_code == 403


def test_a_wrong_method_on_an_ollama_route_is_refused_in_ollamas_shape(
    make_app: AppFactory, live_server: Any
) -> None:
    server = live_server(make_app(ScriptedEngine(("Hi",))))
    refused = httpx.get(f"{server.base_url}/api/chat")
    assert refused.status_code == 405 and set(refused.json()) == {"error"}
