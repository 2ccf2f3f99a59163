"""The HTTP writer: heartbeats, error frames, 499 on a client that leaves, 500s, the log line."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from scripted_engine import ScriptedEngine, ScriptedStream
from starlette.applications import Starlette

from modelhost.engine.sampling.sampling_params import SamplingParams

AppFactory = Callable[..., Starlette]
ClientFactory = Callable[[Starlette], httpx.AsyncClient]
HELLO = {"messages": [{"role": "user", "content": "hi"}]}


def frames_of(text: str) -> list[str]:
    return [frame for frame in text.split("\n\n") if frame]


async def eventually(condition: Callable[[], bool], timeout_s: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.005)
    return True


async def call_and_leave(
    app: Starlette, body: dict[str, Any], *, leave: Callable[[list[dict[str, Any]]], bool]
) -> list[dict[str, Any]]:
    """Drive `app` as an ASGI server would, disconnecting once `leave(sent)` is true."""
    sent: list[dict[str, Any]] = []
    gone = asyncio.Event()
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if leave(sent):
            gone.set()

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 8080),
    }
    task = asyncio.create_task(app(scope, receive, send))
    while not task.done() and not gone.is_set():  # JSON answers send nothing until the end
        if leave(sent):
            gone.set()
        await asyncio.sleep(0.005)
    await asyncio.wait_for(task, timeout=5)
    return sent


async def test_a_stalled_stream_sends_keep_alive_comments_until_tokens_flow_again(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    engine = ScriptedEngine(["a", "b", "c"], stall_after=1, stall_s=0.3)
    client = client_of(make_app(engine, heartbeat_s=0.05))
    response = await client.post("/v1/chat/completions", json={**HELLO, "stream": True})
    frames = frames_of(response.text)
    first_delta = next(i for i, f in enumerate(frames) if '"content":"a"' in f)
    second_delta = next(i for i, f in enumerate(frames) if '"content":"b"' in f)
    heartbeats = [f for f in frames[first_delta:second_delta] if f == ": keep-alive"]
    assert len(heartbeats) >= 2
    assert frames[-1] == "data: [DONE]"


async def test_a_quick_stream_sends_no_keep_alive(
    client: httpx.AsyncClient,
) -> None:
    response = await client.post("/v1/chat/completions", json={**HELLO, "stream": True})
    assert ": keep-alive" not in response.text


async def test_an_error_after_the_stream_opened_is_one_error_frame_and_nothing_after(
    make_app: AppFactory, client_of: ClientFactory, caplog: pytest.LogCaptureFixture
) -> None:
    client = client_of(make_app(ScriptedEngine(["a", "b", "c"], fail_after=2)))
    response = await client.post("/v1/chat/completions", json={**HELLO, "stream": True})
    assert response.status_code == 200
    frames = frames_of(response.text)
    assert json.loads(frames[-1].removeprefix("data: "))["error"]["message"] == "scripted failure"
    assert sum('"error"' in frame for frame in frames) == 1
    assert "data: [DONE]" not in frames
    assert "500 on chatcmpl-" in caplog.text


async def test_a_client_that_leaves_a_stream_cancels_its_row_and_logs_499(
    make_app: AppFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="modelhost.server")
    engine = ScriptedEngine(["tok"] * 10_000, step_s=0.005)
    app = make_app(engine)

    def after_two_deltas(sent: list[dict[str, Any]]) -> bool:
        return sum(b'"content":"tok"' in m.get("body", b"") for m in sent) >= 2

    await call_and_leave(app, {**HELLO, "stream": True}, leave=after_two_deltas)
    assert engine.num_cancelled == 1
    assert await eventually(lambda: engine.stats().active_rows == 0)
    assert " 499 " in caplog.text
    assert "500 on" not in caplog.text


async def test_a_client_that_abandons_a_json_request_cancels_its_row_with_499(
    make_app: AppFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="modelhost.server")
    engine = ScriptedEngine(["tok"] * 10_000, step_s=0.005)
    app = make_app(engine)
    started = time.monotonic()

    def after_50_ms(sent: list[dict[str, Any]]) -> bool:
        return time.monotonic() - started > 0.05

    sent = await call_and_leave(app, HELLO, leave=after_50_ms)
    assert engine.num_cancelled == 1
    assert await eventually(lambda: engine.stats().active_rows == 0)
    assert sent[0]["status"] == 499
    assert json.loads(sent[1]["body"])["error"]["code"] == "request_cancelled"
    assert "500 on" not in caplog.text


async def test_an_unexpected_failure_is_a_500_with_its_message_and_its_stack_logged(
    make_app: AppFactory, client_of: ClientFactory, caplog: pytest.LogCaptureFixture
) -> None:
    class BrokenEngine(ScriptedEngine):
        def submit(self, prompt_ids: list[int], params: SamplingParams) -> ScriptedStream:
            raise RuntimeError("the engine broke")

    client = client_of(make_app(BrokenEngine()))
    response = await client.post("/v1/chat/completions", json=HELLO)
    assert response.status_code == 500
    assert response.json()["error"]["message"] == "the engine broke"
    assert "500 on chatcmpl-" in caplog.text
    assert "Traceback" in caplog.text


async def test_each_request_logs_one_line_with_id_status_tokens_ttft_and_total(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="modelhost.server")
    body = (await client.post("/v1/chat/completions", json=HELLO)).json()
    lines = [r.getMessage() for r in caplog.records if r.name == "modelhost.server"]
    assert len(lines) == 1
    line = lines[0]
    assert line.startswith(f"{body['id']} POST /v1/chat/completions 200 ")
    assert f"prompt_tokens={body['usage']['prompt_tokens']}" in line
    assert "completion_tokens=4" in line
    assert "ttft_ms=" in line and "ttft_ms=-" not in line
    assert "total_ms=" in line


async def test_a_refused_request_logs_its_status_too(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="modelhost.server")
    await client.post("/v1/chat/completions", json={})
    [line] = [r.getMessage() for r in caplog.records if r.name == "modelhost.server"]
    assert " 400 prompt_tokens=- " in line


async def test_warnings_ride_in_a_warning_header_on_streams_too(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MODELHOST_GRAMMAR", "0")
    body = {**HELLO, "stream": True, "response_format": {"type": "json_object"}}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.headers["warning"].startswith("grammar not enforced")
