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
    assert "<|im_start|>tool\nsunny, 21C<|im_end|>" in prompt


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
