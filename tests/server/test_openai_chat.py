"""POST /v1/chat/completions over a scripted engine: shapes, SSE order, validation, admission."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from scripted_engine import ScriptedEngine, scripted_model
from starlette.applications import Starlette

from modelhost.engine.sampling.sampling_params import SamplingParams

AppFactory = Callable[..., Starlette]
ClientFactory = Callable[[Starlette], httpx.AsyncClient]
HELLO = {"messages": [{"role": "user", "content": "hi"}]}


def sse_payloads(text: str) -> list[Any]:
    """The `data:` payloads of an SSE body, JSON-decoded except `[DONE]`."""
    payloads: list[Any] = []
    for frame in text.split("\n\n"):
        if frame.startswith("data: "):
            data = frame[len("data: ") :]
            payloads.append(data if data == "[DONE]" else json.loads(data))
    return payloads


async def post(app_client: httpx.AsyncClient, body: Any, **kwargs: Any) -> httpx.Response:
    return await app_client.post("/v1/chat/completions", json=body, **kwargs)


async def test_chat_json_answer_has_openai_shape_with_usage_and_lane(
    client: httpx.AsyncClient,
) -> None:
    response = await post(client, {**HELLO, "model": "anything"})
    assert response.status_code == 200
    body = response.json()
    assert body["id"].startswith("chatcmpl-")
    assert body["object"] == "chat.completion"
    assert body["model"] == "scripted-model"
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "Hello, world!"}
    assert choice["finish_reason"] == "stop"
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["completion_tokens"] == 4
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
    assert usage["lane"] == "batched"


async def test_chat_usage_reports_the_cached_prompt_tokens(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    app = make_app(ScriptedEngine(cached_tokens=7))
    client = client_of(app)
    body = (await post(client, HELLO)).json()
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 7


async def test_chat_stream_sends_primer_deltas_terminal_chunk_then_done(
    client: httpx.AsyncClient,
) -> None:
    response = await post(client, {**HELLO, "stream": True})
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["cache-control"] == "no-cache"
    payloads = sse_payloads(response.text)
    assert payloads[-1] == "[DONE]"
    chunks = payloads[:-1]
    assert {chunk["object"] for chunk in chunks} == {"chat.completion.chunk"}
    assert len({chunk["id"] for chunk in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [chunk["choices"][0]["delta"]["content"] for chunk in chunks[1:-1]]
    assert "".join(deltas) == "Hello, world!"
    assert all(chunk["choices"][0]["finish_reason"] is None for chunk in chunks[:-1])
    terminal = chunks[-1]
    assert terminal["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "stop",
    }
    assert terminal["usage"]["lane"] == "batched"


async def test_chat_stream_with_include_usage_ends_with_a_usage_chunk_without_choices(
    client: httpx.AsyncClient,
) -> None:
    body = {**HELLO, "stream": True, "stream_options": {"include_usage": True}}
    payloads = sse_payloads((await post(client, body)).text)
    assert payloads[-1] == "[DONE]"
    usage_chunk, finish_chunk = payloads[-2], payloads[-3]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 4
    assert finish_chunk["choices"][0]["finish_reason"] == "stop"
    assert "usage" not in finish_chunk


async def test_max_tokens_ends_the_answer_with_length(client: httpx.AsyncClient) -> None:
    body = (await post(client, {**HELLO, "max_tokens": 2})).json()
    assert body["choices"][0]["message"]["content"] == "Hello,"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 2


async def test_max_completion_tokens_wins_over_max_tokens(client: httpx.AsyncClient) -> None:
    body = (await post(client, {**HELLO, "max_tokens": 3, "max_completion_tokens": 1})).json()
    assert body["usage"]["completion_tokens"] == 1


async def test_a_stop_string_ends_the_answer_with_stop_and_is_never_shown(
    client: httpx.AsyncClient,
) -> None:
    body = (await post(client, {**HELLO, "stop": [" world"]})).json()
    assert body["choices"][0]["message"]["content"] == "Hello,"
    assert body["choices"][0]["finish_reason"] == "stop"


async def test_logprobs_come_back_per_token_with_the_requested_alternatives(
    client: httpx.AsyncClient,
) -> None:
    body = (await post(client, {**HELLO, "logprobs": True, "top_logprobs": 2})).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert [entry["token"] for entry in content] == ["Hello", ",", " world", "!"]
    first = content[0]
    assert set(first) == {"id", "token", "logprob", "bytes", "top_logprobs"}
    assert len(first["top_logprobs"]) == 2
    assert first["bytes"] == list(b"Hello")


async def test_logprobs_are_null_when_not_asked_for(client: httpx.AsyncClient) -> None:
    body = (await post(client, HELLO)).json()
    assert body["choices"][0]["logprobs"] is None


async def test_request_sampling_knobs_reach_the_engine(
    client: httpx.AsyncClient, engine: ScriptedEngine
) -> None:
    body = {**HELLO, "temperature": 0.2, "top_p": 0.9, "top_k": 4, "seed": 11, "stop": "x"}
    await post(client, body)
    params = engine.submissions[0].params
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (0.2, 0.9, 4, 11)
    assert params.stop == ("x",)


async def test_serve_flags_and_model_defaults_fill_what_the_request_leaves_unset(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    engine = ScriptedEngine()
    model = scripted_model(gen_defaults={"temperature": 0.6, "top_k": 20})
    app = make_app(engine, model, top_p=0.5)
    client = client_of(app)
    await post(client, HELLO)
    params = engine.submissions[0].params
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.5, 20)


async def test_developer_messages_are_rendered_as_system_and_text_parts_are_joined(
    client: httpx.AsyncClient, engine: ScriptedEngine
) -> None:
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    await post(client, {"messages": messages})
    rendered = scripted_model().tokenizer.decode(engine.submissions[0].prompt_ids, False)
    assert rendered.startswith("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\na\nb")


async def test_structured_output_with_grammars_disabled_is_answered_with_a_warning_header(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MODELHOST_GRAMMAR", "0")
    response = await post(client, {**HELLO, "response_format": {"type": "json_object"}})
    assert response.status_code == 200
    assert response.headers["warning"].startswith("grammar not enforced")


@pytest.mark.parametrize("stream", [False, True])
async def test_n_above_one_is_a_json_501_before_any_stream_opens(
    client: httpx.AsyncClient, engine: ScriptedEngine, stream: bool
) -> None:
    response = await post(client, {**HELLO, "n": 2, "stream": stream})
    assert response.status_code == 501
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert error["type"] == "not_implemented"
    assert error["code"] == "unsupported_execution"
    assert error["reasons"] == ["multi-choice-batch-unsupported"]
    assert engine.submissions == []


async def test_image_parts_on_a_text_only_model_are_a_400_no_vision_sidecar(
    client: httpx.AsyncClient,
) -> None:
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
    response = await post(client, {"messages": [{"role": "user", "content": [part]}]})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "model has no vision sidecar"


async def test_a_full_queue_is_a_429_queue_full(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    engine = ScriptedEngine(["a"] * 1000, step_s=0.05, batch=1, max_queue=0)
    app = make_app(engine)
    engine.submit([1], SamplingParams())  # the only slot is taken
    client = client_of(app)
    response = await post(client, HELLO)
    engine.close()
    assert response.status_code == 429
    assert response.json()["error"] == {
        "message": "admission queue is full",
        "type": "resource_admission",
        "code": "queue_full",
        "param": None,
    }


async def test_a_prompt_longer_than_the_context_window_is_a_400_context_length_exceeded(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    app = make_app(ScriptedEngine(), scripted_model(context_length=16))
    client = client_of(app)
    response = await post(client, HELLO)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "context_length_exceeded")
    assert error["message"].startswith(
        "This model's maximum context length is 16 tokens. However, your messages resulted in "
        "21 tokens."
    )


async def test_a_small_memory_budget_clamps_max_tokens_silently(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    engine = ScriptedEngine()
    model = scripted_model(context_length=1 << 20, weights_bytes=1_000_000)
    app = make_app(engine, model, memory_budget_gb=0.002)
    client = client_of(app)
    safe = (await client.get("/stats")).json()["admission"]["max_safe_context"]
    response = await post(client, {**HELLO, "max_tokens": 10 * safe})
    assert response.status_code == 200
    assert "warning" not in response.headers
    assert engine.submissions[0].params.max_tokens == safe - 21


async def test_a_small_memory_budget_refuses_a_prompt_that_fills_it(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    model = scripted_model(context_length=1 << 20, weights_bytes=1_000_000)
    app = make_app(ScriptedEngine(), model, memory_budget_gb=0.002)
    client = client_of(app)
    safe = (await client.get("/stats")).json()["admission"]["max_safe_context"]
    long_prompt = {"messages": [{"role": "user", "content": "x" * safe}]}
    response = await post(client, long_prompt)
    assert response.status_code == 400
    error = response.json()["error"]  # the budget's safe context is the window a client sees
    assert error["code"] == "context_length_exceeded"
    assert error["message"].startswith(f"This model's maximum context length is {safe} tokens.")
