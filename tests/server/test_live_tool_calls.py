"""The official SDKs read tool calls and reasoning from a real server on a loopback port, over a
scripted Qwen3-family model that writes `<think>` and `<tool_call>` markup."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import anthropic
import openai
from scripted_engine import ScriptedEngine, scripted_model
from starlette.applications import Starlette

AppFactory = Callable[..., Starlette]
SCRIPT = (
    "<think>", "Use the tool.", "</think>", "<tool_call>",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}', "</tool_call>",
)  # fmt: skip
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def start(make_app: AppFactory, live_server: Any) -> tuple[str, ScriptedEngine]:
    engine = ScriptedEngine(SCRIPT)
    server = live_server(make_app(engine, scripted_model(family="qwen3")))
    return server.base_url, engine


def test_the_openai_sdk_reads_tool_calls_from_chat(make_app: AppFactory, live_server: Any) -> None:
    base_url, _ = start(make_app, live_server)
    tool: Any = {"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0) as client:
        completion = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Paris?"}], tools=[tool]
        )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls or []
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(call.function.arguments) == {"city": "Paris"}  # type: ignore[union-attr]


def test_the_anthropic_sdk_round_trips_a_tool_use_into_the_next_prompt(
    make_app: AppFactory, live_server: Any
) -> None:
    base_url, engine = start(make_app, live_server)
    tool: Any = {"name": "get_weather", "input_schema": PARAMETERS}
    question: Any = {"role": "user", "content": "Paris?"}
    with anthropic.Anthropic(base_url=base_url, api_key="none", max_retries=0) as client:
        first = client.messages.create(model="m", max_tokens=64, messages=[question], tools=[tool])
        use = next(block for block in first.content if block.type == "tool_use")
        result: Any = {"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21C"}
        client.messages.create(
            model="m",
            max_tokens=64,
            tools=[tool],
            messages=[
                question,
                {"role": "assistant", "content": first.content},  # type: ignore[typeddict-item]
                {"role": "user", "content": [result]},
            ],
        )
    assert first.stop_reason == "tool_use"
    assert [block.type for block in first.content] == ["thinking", "tool_use"]
    assert use.input == {"city": "Paris"}  # type: ignore[union-attr]
    prompt = scripted_model().tokenizer.decode(engine.submissions[-1].prompt_ids, False)
    assert "<tool_response>\nsunny, 21C\n</tool_response>" in prompt  # built-in tool prompt


def test_the_openai_sdk_reads_function_call_items_from_responses(
    make_app: AppFactory, live_server: Any
) -> None:
    base_url, _ = start(make_app, live_server)
    tool: Any = {"type": "function", "name": "get_weather", "parameters": PARAMETERS}
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0) as client:
        response = client.responses.create(model="m", input="Paris?", tools=[tool])
        follow_up = client.responses.create(
            model="m",
            previous_response_id=response.id,
            input=[
                {
                    "type": "function_call_output",
                    "call_id": response.output[-1].call_id,  # type: ignore[union-attr]
                    "output": "sunny",
                }
            ],
            tools=[tool],
        )
    assert [item.type for item in response.output] == ["reasoning", "function_call"]
    call = response.output[-1]
    assert call.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(call.arguments) == {"city": "Paris"}  # type: ignore[union-attr]
    assert follow_up.status == "completed"
