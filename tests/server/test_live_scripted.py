"""A real uvicorn server on a loopback port over a scripted engine: the OpenAI SDK, raw SSE
over sockets, disconnects, the queue bound, and shutdown."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
from scripted_engine import ScriptedEngine
from starlette.applications import Starlette

AppFactory = Callable[..., Starlette]
HELLO = [{"role": "user", "content": "hi"}]


def wait_until(condition: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def sdk(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=10)


def test_the_openai_sdk_reads_a_chat_answer_and_a_streamed_one(
    make_app: AppFactory, live_server: Any
) -> None:
    server = live_server(make_app())
    with sdk(server.base_url) as client:
        answer = client.chat.completions.create(model="scripted-model", messages=HELLO)
        assert answer.choices[0].message.content == "Hello, world!"
        assert answer.usage is not None and answer.usage.completion_tokens == 4
        stream = client.chat.completions.create(
            model="scripted-model",
            messages=HELLO,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello, world!"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.total_tokens == answer.usage.total_tokens


def test_the_openai_sdk_raises_the_servers_error_for_a_mid_stream_failure(
    make_app: AppFactory, live_server: Any
) -> None:
    server = live_server(make_app(ScriptedEngine(["a", "b"], fail_after=1)))
    with sdk(server.base_url) as client:
        stream = client.chat.completions.create(model="m", messages=HELLO, stream=True)
        with pytest.raises(openai.APIError, match="scripted failure"):
            list(stream)


def test_closing_a_stream_over_a_socket_frees_the_row_within_a_step(
    make_app: AppFactory, live_server: Any
) -> None:
    engine = ScriptedEngine(["tok"] * 100_000, step_s=0.005)
    server = live_server(make_app(engine))
    base = server.base_url
    body = {"messages": HELLO, "stream": True}
    with (
        httpx.Client(base_url=base, timeout=10) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        lines = response.iter_lines()
        assert sum(1 for _, line in zip(range(5), lines, strict=False) if line) >= 2
    assert wait_until(lambda: httpx.get(f"{base}/stats").json()["batch"]["active_rows"] == 0)
    assert engine.num_cancelled == 1


def test_a_stalled_stream_over_a_socket_gets_keep_alive_comments(
    make_app: AppFactory, live_server: Any
) -> None:
    engine = ScriptedEngine(["a", "b"], stall_after=1, stall_s=0.4)
    server = live_server(make_app(engine, heartbeat_s=0.1))
    body = {"messages": HELLO, "stream": True}
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        text = client.post("/v1/chat/completions", json=body).text
    assert text.count(": keep-alive\n\n") >= 2
    assert text.endswith("data: [DONE]\n\n")


def test_a_third_concurrent_request_is_a_429_with_batch_1_and_max_queue_1(
    make_app: AppFactory, live_server: Any
) -> None:
    engine = ScriptedEngine(["tok"] * 40, step_s=0.01, batch=1, max_queue=1)
    server = live_server(make_app(engine))
    statuses: list[int] = []

    def ask() -> None:
        with httpx.Client(base_url=server.base_url, timeout=10) as client:
            statuses.append(
                client.post("/v1/chat/completions", json={"messages": HELLO}).status_code
            )

    threads = [threading.Thread(target=ask) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert sorted(statuses) == [200, 200, 429]


def test_shutdown_ends_a_stream_that_outlives_the_grace_period_with_a_closing_error_frame(
    make_app: AppFactory, live_server: Any
) -> None:
    engine = ScriptedEngine(["tok"] * 100_000, step_s=0.01)
    server = live_server(make_app(engine), shutdown_timeout_s=0.5)
    body = {"messages": HELLO, "stream": True}
    with (
        httpx.Client(base_url=server.base_url, timeout=10) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        lines = response.iter_lines()
        next(lines)
        started = time.monotonic()
        server.stop()
        assert time.monotonic() - started < 5
        rest = [line for line in lines if line]
    assert not server.thread.is_alive()
    assert engine.closed
    assert json.loads(rest[-1].removeprefix("data: "))["error"]["code"] == "closed"
    assert "data: [DONE]" not in rest


def test_a_chat_message_without_content_is_a_400_naming_it_as_openai_does(
    make_app: AppFactory, live_server: Any
) -> None:
    server = live_server(make_app())
    messages: Any = [{"role": "system", "content": "Be brief."}, {"role": "user"}]
    with sdk(server.base_url) as client, pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="scripted-model", messages=messages)
    assert refused.value.status_code == 400
    assert refused.value.param == "messages[1].content"
    assert refused.value.code == "missing_required_parameter"
    assert refused.value.message.endswith("Missing required parameter: 'messages[1].content'.")


def test_a_chat_message_whose_content_is_null_is_a_400_naming_it_as_openai_does(
    make_app: AppFactory, live_server: Any
) -> None:
    server = live_server(make_app())
    messages: Any = [{"role": "user", "content": None}]
    with sdk(server.base_url) as client, pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="scripted-model", messages=messages)
    assert refused.value.param == "messages[0].content"
    assert refused.value.code == "invalid_type"


def test_an_assistant_turn_of_only_tool_calls_needs_no_content(
    make_app: AppFactory, live_server: Any
) -> None:
    server = live_server(make_app())
    call = {"id": "call_1", "type": "function", "function": {"name": "now", "arguments": "{}"}}
    messages: Any = [
        {"role": "user", "content": "What time is it?"},
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "noon"},
    ]
    with sdk(server.base_url) as client:
        answer = client.chat.completions.create(model="scripted-model", messages=messages)
    assert answer.choices[0].message.content == "Hello, world!"
