"""POST /v1/responses and GET /v1/responses/{id} over a scripted engine: shapes, the SSE event
sequence, previous_response_id continuation (and its 404), input items and the error shape."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from scripted_engine import ScriptedEngine, scripted_model
from starlette.applications import Starlette

from modelhost.server.responses.store import ResponseStore

AppFactory = Callable[..., Starlette]
ClientFactory = Callable[[Starlette], httpx.AsyncClient]
HELLO: dict[str, Any] = {"model": "scripted-model", "input": "hi"}


def sse_events(text: str) -> list[tuple[str, Any]]:
    events = []
    for frame in text.split("\n\n"):
        lines = frame.split("\n")
        if lines[0].startswith("event: "):
            data = json.loads(lines[1].removeprefix("data: "))
            events.append((lines[0].removeprefix("event: "), data))
    return events


async def post(client: httpx.AsyncClient, body: Any) -> httpx.Response:
    return await client.post("/v1/responses", json=body)


def rendered_prompt(engine: ScriptedEngine) -> str:
    return scripted_model().tokenizer.decode(engine.submissions[-1].prompt_ids, False)


def answer_text(response: dict[str, Any]) -> str:
    return "".join(part["text"] for part in response["output"][0]["content"])


# ---- JSON -------------------------------------------------------------------------------------


async def test_a_response_has_the_responses_shape_and_usage(client: httpx.AsyncClient) -> None:
    response = await post(client, HELLO)
    assert response.status_code == 200
    body = response.json()
    assert body["id"].startswith("resp_")
    assert body["object"] == "response"
    assert body["status"] == "completed"
    assert body["model"] == "scripted-model"
    (item,) = body["output"]
    assert item["type"] == "message" and item["role"] == "assistant"
    assert item["status"] == "completed"
    assert item["content"] == [{"type": "output_text", "text": "Hello, world!", "annotations": []}]
    usage = body["usage"]
    assert usage["output_tokens"] == 4
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert usage["input_tokens_details"] == {"cached_tokens": 0}


async def test_max_output_tokens_makes_the_response_incomplete(client: httpx.AsyncClient) -> None:
    body = (await post(client, {**HELLO, "max_output_tokens": 2})).json()
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert answer_text(body) == "Hello,"
    assert body["max_output_tokens"] == 2


async def test_sampling_fields_reach_the_sampler_and_are_echoed(
    engine: ScriptedEngine, client: httpx.AsyncClient
) -> None:
    body = (await post(client, {**HELLO, "temperature": 0.4, "top_p": 0.9, "top_k": 3})).json()
    params = engine.submissions[-1].params
    assert (params.temperature, params.top_p, params.top_k) == (0.4, 0.9, 3)
    assert (body["temperature"], body["top_p"]) == (0.4, 0.9)


# ---- SSE --------------------------------------------------------------------------------------


async def test_a_streamed_response_sends_the_responses_event_sequence(
    client: httpx.AsyncClient,
) -> None:
    response = await post(client, {**HELLO, "stream": True})
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    assert [name for name, _ in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 4,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert all(data["type"] == name for name, data in events)


async def test_a_streamed_response_completes_with_the_same_answer_as_json(
    client: httpx.AsyncClient,
) -> None:
    events = sse_events((await post(client, {**HELLO, "stream": True})).text)
    deltas = "".join(d["delta"] for n, d in events if n == "response.output_text.delta")
    assert deltas == "Hello, world!"
    created, completed = events[0][1]["response"], events[-1][1]["response"]
    assert created["status"] == "in_progress" and created["output"] == []
    assert completed["id"] == created["id"]
    assert completed["status"] == "completed"
    assert answer_text(completed) == "Hello, world!"
    assert completed["usage"]["output_tokens"] == 4


async def test_a_stream_cut_by_max_output_tokens_ends_with_response_incomplete(
    client: httpx.AsyncClient,
) -> None:
    events = sse_events(
        (await post(client, {**HELLO, "max_output_tokens": 2, "stream": True})).text
    )
    name, data = events[-1]
    assert name == "response.incomplete"
    assert data["response"]["status"] == "incomplete"
    assert data["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert "response.completed" not in [n for n, _ in events]


async def test_an_error_after_the_stream_opened_ends_it_with_response_failed(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    client = client_of(make_app(ScriptedEngine(["a", "b", "c"], fail_after=2)))
    events = sse_events((await post(client, {**HELLO, "stream": True})).text)
    name, data = events[-1]
    assert name == "response.failed"
    assert data["response"]["status"] == "failed"
    assert data["response"]["error"] == {"code": "server_error", "message": "scripted failure"}
    assert "response.completed" not in [n for n, _ in events]
    retrieved = await client.get(f"/v1/responses/{data['response']['id']}")
    assert retrieved.status_code == 404


# ---- the store --------------------------------------------------------------------------------


async def test_previous_response_id_continues_the_stored_conversation(
    engine: ScriptedEngine, client: httpx.AsyncClient
) -> None:
    first = (await post(client, {**HELLO, "input": "My name is Ada."})).json()
    follow_up = {**HELLO, "input": "What is it?", "previous_response_id": first["id"]}
    second = await post(client, follow_up)
    assert second.status_code == 200
    assert second.json()["previous_response_id"] == first["id"]
    prompt = rendered_prompt(engine)
    turns = [
        "<|im_start|>user\nMy name is Ada.<|im_end|>",
        "<|im_start|>assistant\nHello, world!<|im_end|>",
        "<|im_start|>user\nWhat is it?<|im_end|>",
    ]
    positions = [prompt.index(turn) for turn in turns]
    assert positions == sorted(positions)


async def test_a_chain_of_three_responses_carries_every_earlier_turn(
    engine: ScriptedEngine, client: httpx.AsyncClient
) -> None:
    previous = None
    for word in ("one", "two", "three"):
        body = {**HELLO, "input": word, "stream": True, "previous_response_id": previous}
        events = sse_events((await post(client, body)).text)
        previous = events[-1][1]["response"]["id"]
    prompt = rendered_prompt(engine)
    assert prompt.count("<|im_start|>user") == 3
    assert prompt.count("Hello, world!") == 2


async def test_instructions_carry_over_to_a_continued_response(
    engine: ScriptedEngine, client: httpx.AsyncClient
) -> None:
    first = (await post(client, {**HELLO, "instructions": "Be terse."})).json()
    await post(client, {**HELLO, "previous_response_id": first["id"]})
    assert rendered_prompt(engine).startswith("<|im_start|>system\nBe terse.<|im_end|>")


async def test_an_unknown_previous_response_id_is_a_404_in_the_responses_error_shape(
    client: httpx.AsyncClient,
) -> None:
    response = await post(client, {**HELLO, "previous_response_id": "resp_nope"})
    assert response.status_code == 404
    assert response.json() == {
        "error": {
            "message": "previous_response_id 'resp_nope' not found or expired",
            "type": "invalid_request_error",
            "param": "previous_response_id",
            "code": "not_found",
        }
    }


async def test_an_expired_previous_response_id_is_a_404(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    now = [0.0]
    app = make_app()
    app.state.response_store = ResponseStore(clock=lambda: now[0])
    client = client_of(app)
    first = (await post(client, HELLO)).json()
    now[0] = 3600.0
    response = await post(client, {**HELLO, "previous_response_id": first["id"]})
    assert response.status_code == 404


async def test_a_response_with_store_false_cannot_be_continued_or_retrieved(
    client: httpx.AsyncClient,
) -> None:
    first = (await post(client, {**HELLO, "store": False})).json()
    assert first["store"] is False
    assert (await post(client, {**HELLO, "previous_response_id": first["id"]})).status_code == 404
    assert (await client.get(f"/v1/responses/{first['id']}")).status_code == 404


async def test_a_stored_response_can_be_retrieved_by_id(client: httpx.AsyncClient) -> None:
    first = (await post(client, HELLO)).json()
    retrieved = await client.get(f"/v1/responses/{first['id']}")
    assert retrieved.status_code == 200
    assert retrieved.json() == first


# ---- input items ------------------------------------------------------------------------------


async def test_instructions_and_developer_messages_become_one_leading_system_turn(
    engine: ScriptedEngine, client: httpx.AsyncClient
) -> None:
    body = {
        **HELLO,
        "instructions": "Be terse.",
        "input": [
            {"role": "developer", "content": "Use French."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        ],
    }
    assert (await post(client, body)).status_code == 200
    prompt = rendered_prompt(engine)
    assert prompt.startswith("<|im_start|>system\nBe terse.\n\nUse French.<|im_end|>")
    assert prompt.count("<|im_start|>system") == 1


async def test_function_call_items_render_as_assistant_and_tool_turns(
    engine: ScriptedEngine, client: httpx.AsyncClient
) -> None:
    body = {
        **HELLO,
        "tools": [{"type": "function", "name": "weather", "parameters": {"type": "object"}}],
        "input": [
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "Sunny, 21C"},
        ],
    }
    response = await post(client, body)
    assert response.status_code == 200
    assert response.json()["tools"] == body["tools"]
    prompt = rendered_prompt(engine)
    # the scripted template renders no tools: the built-in tool prompt's shapes
    call = prompt.index('<|im_start|>assistant\n<tool_call>\n{"name": "weather"')
    assert call < prompt.index("<|im_start|>user\n<tool_response>\nSunny, 21C\n</tool_response>")


async def test_an_image_part_is_a_400_in_the_responses_error_shape(
    client: httpx.AsyncClient,
) -> None:
    part = {"type": "input_image", "image_url": "data:image/png;base64,"}
    response = await post(client, {**HELLO, "input": [{"role": "user", "content": [part]}]})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"] == "model has no vision sidecar"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"model": "m"}, "input must be a string or an array of items"),
        ({**HELLO, "input": 5}, "input must be a string or an array of items"),
        ({**HELLO, "previous_response_id": 5}, "previous_response_id must be of type str"),
        ({**HELLO, "max_output_tokens": "9"}, "max_output_tokens must be of type int"),
        ({**HELLO, "temperature": "hot"}, "temperature must be of type float"),
        ({**HELLO, "input": [{"type": "hologram"}]}, "input[0] has an unsupported type 'hologram'"),
        (
            {**HELLO, "input": [{"role": "robot", "content": "x"}]},
            "input[0].role must be one of 'user', 'assistant', 'system', 'developer'",
        ),
    ],
)
async def test_a_malformed_body_is_a_400_in_the_responses_error_shape(
    client: httpx.AsyncClient, body: dict[str, Any], message: str
) -> None:
    response = await post(client, body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["message"] == message
    assert error["type"] == "invalid_request_error"
    assert set(error) >= {"message", "type", "param", "code"}


async def test_unknown_fields_are_ignored(client: httpx.AsyncClient) -> None:
    body = {**HELLO, "truncation": "auto", "reasoning": {"effort": "low"}, "some_new_field": 1}
    assert (await post(client, body)).status_code == 200


async def test_stats_report_the_response_store(client: httpx.AsyncClient) -> None:
    await post(client, HELLO)
    store = (await client.get("/stats")).json()["response_store"]
    assert store["entries"] == 1
    assert 0 < store["bytes"] <= store["max_bytes"]
    assert store["ttl_s"] == 3600


async def test_retrieving_an_unknown_response_is_a_404(client: httpx.AsyncClient) -> None:
    response = await client.get("/v1/responses/resp_nope")
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "invalid_request_error"
