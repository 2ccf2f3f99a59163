"""POST /v1/completions over a scripted engine: raw prompts, shapes, SSE and legacy logprobs."""

from __future__ import annotations

import json
from typing import Any

import httpx
from scripted_engine import ScriptedEngine, scripted_model


def sse_payloads(text: str) -> list[Any]:
    payloads: list[Any] = []
    for frame in text.split("\n\n"):
        if frame.startswith("data: "):
            data = frame[len("data: ") :]
            payloads.append(data if data == "[DONE]" else json.loads(data))
    return payloads


async def test_completion_json_answer_has_openai_text_completion_shape(
    client: httpx.AsyncClient,
) -> None:
    response = await client.post("/v1/completions", json={"prompt": "Once", "model": "x"})
    assert response.status_code == 200
    body = response.json()
    assert body["id"].startswith("cmpl-")
    assert body["object"] == "text_completion"
    assert body["model"] == "scripted-model"
    assert body["choices"] == [
        {"index": 0, "text": "Hello, world!", "logprobs": None, "finish_reason": "stop"}
    ]
    assert body["usage"]["prompt_tokens"] == 4
    assert body["usage"]["total_tokens"] == 8
    assert body["usage"]["lane"] == "batched"


async def test_the_prompt_is_tokenized_raw_without_a_template(
    client: httpx.AsyncClient, engine: ScriptedEngine
) -> None:
    await client.post("/v1/completions", json={"prompt": "Once"})
    assert scripted_model().tokenizer.decode(engine.submissions[0].prompt_ids, False) == "Once"


async def test_completion_stream_sends_text_chunks_a_terminal_chunk_then_done(
    client: httpx.AsyncClient,
) -> None:
    response = await client.post("/v1/completions", json={"prompt": "Once", "stream": True})
    payloads = sse_payloads(response.text)
    assert payloads[-1] == "[DONE]"
    chunks = payloads[:-1]
    assert {chunk["object"] for chunk in chunks} == {"text_completion"}
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == "Hello, world!"
    assert [chunk["choices"][0]["finish_reason"] for chunk in chunks][-1] == "stop"
    assert all(chunk["choices"][0]["finish_reason"] is None for chunk in chunks[:-1])
    assert chunks[-1]["usage"]["completion_tokens"] == 4


async def test_completion_stream_with_include_usage_ends_with_a_usage_chunk(
    client: httpx.AsyncClient,
) -> None:
    body = {"prompt": "Once", "stream": True, "stream_options": {"include_usage": True}}
    payloads = sse_payloads((await client.post("/v1/completions", json=body)).text)
    assert payloads[-2]["choices"] == []
    assert payloads[-2]["usage"]["total_tokens"] == 8
    assert "usage" not in payloads[-3]


async def test_completion_max_tokens_ends_with_length(client: httpx.AsyncClient) -> None:
    body = (await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})).json()
    assert (body["choices"][0]["text"], body["choices"][0]["finish_reason"]) == ("Hello", "length")


async def test_completion_logprobs_use_the_legacy_shape(client: httpx.AsyncClient) -> None:
    body = (await client.post("/v1/completions", json={"prompt": "a", "logprobs": 2})).json()
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["Hello", ",", " world", "!"]
    assert logprobs["token_logprobs"] == [-0.5] * 4
    assert logprobs["text_offset"] == [0, 5, 6, 12]
    assert all(len(top) == 2 for top in logprobs["top_logprobs"])


async def test_completion_logprobs_true_reports_the_chosen_tokens_only(
    client: httpx.AsyncClient,
) -> None:
    body = (await client.post("/v1/completions", json={"prompt": "a", "logprobs": True})).json()
    assert body["choices"][0]["logprobs"]["top_logprobs"] == [{}, {}, {}, {}]
