"""POST /v1/messages and /v1/messages/count_tokens over a scripted engine: shapes, the SSE event
order, stop reasons, block flattening, sampling, pings and the Anthropic error envelope."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from scripted_engine import ScriptedEngine, scripted_model
from starlette.applications import Starlette

AppFactory = Callable[..., Starlette]
ClientFactory = Callable[[Starlette], httpx.AsyncClient]
HELLO: dict[str, Any] = {
    "model": "scripted-model",
    "max_tokens": 64,
    "messages": [{"role": "user", "content": "hi"}],
}


def sse_events(text: str) -> list[tuple[str, Any]]:
    """(event name, decoded data) for each `event:` frame of an SSE body."""
    events = []
    for frame in text.split("\n\n"):
        lines = frame.split("\n")
        if lines[0].startswith("event: "):
            data = json.loads(lines[1].removeprefix("data: "))
            events.append((lines[0].removeprefix("event: "), data))
    return events


async def post(client: httpx.AsyncClient, body: Any) -> httpx.Response:
    return await client.post("/v1/messages", json=body)


def rendered_prompt(engine: ScriptedEngine) -> str:
    return scripted_model().tokenizer.decode(engine.submissions[-1].prompt_ids, False)


# ---- JSON -------------------------------------------------------------------------------------


async def test_a_message_answer_has_the_anthropic_shape(client: httpx.AsyncClient) -> None:
    response = await post(client, HELLO)
    assert response.status_code == 200
    body = response.json()
    assert body["id"].startswith("msg_")
    assert body["type"] == "message"
    assert body["role"] == "assistant"
    assert body["model"] == "scripted-model"
    assert body["content"] == [{"type": "text", "text": "Hello, world!"}]
    assert body["stop_reason"] == "end_turn"
    assert body["stop_sequence"] is None
    assert body["usage"]["output_tokens"] == 4
    assert body["usage"]["input_tokens"] > 0
    assert body["usage"]["cache_read_input_tokens"] == 0
    assert body["usage"]["cache_creation_input_tokens"] == 0


async def test_max_tokens_ends_the_message_with_stop_reason_max_tokens(
    client: httpx.AsyncClient,
) -> None:
    body = (await post(client, {**HELLO, "max_tokens": 2})).json()
    assert body["content"][0]["text"] == "Hello,"
    assert body["stop_reason"] == "max_tokens"
    assert body["usage"]["output_tokens"] == 2


async def test_a_stop_sequence_ends_the_message_with_stop_reason_stop_sequence_naming_it(
    client: httpx.AsyncClient,
) -> None:
    body = (await post(client, {**HELLO, "stop_sequences": [" world"]})).json()
    assert body["content"][0]["text"] == "Hello,"
    assert body["stop_reason"] == "stop_sequence"
    assert body["stop_sequence"] == " world"


async def test_a_stop_sequence_cuts_the_text_before_it(client: httpx.AsyncClient) -> None:
    body = (await post(client, {**HELLO, "stop_sequences": [" world"]})).json()
    assert body["content"][0]["text"] == "Hello,"


async def test_cached_prompt_tokens_are_reported_apart_from_input_tokens(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    plain = (await post(client_of(make_app()), HELLO)).json()["usage"]
    cached = (await post(client_of(make_app(ScriptedEngine(cached_tokens=7))), HELLO)).json()
    assert cached["usage"]["cache_read_input_tokens"] == 7
    assert cached["usage"]["input_tokens"] == plain["input_tokens"] - 7


# ---- SSE --------------------------------------------------------------------------------------


async def test_a_streamed_message_sends_the_anthropic_event_order(
    client: httpx.AsyncClient,
) -> None:
    response = await post(client, {**HELLO, "stream": True})
    assert response.headers["content-type"].startswith("text/event-stream")
    names = [name for name, _ in sse_events(response.text)]
    assert names == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * 4,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert "[DONE]" not in response.text


async def test_a_streamed_message_carries_the_text_stop_reason_and_usage(
    client: httpx.AsyncClient,
) -> None:
    events = dict(sse_events((await post(client, {**HELLO, "stream": True})).text))
    deltas = sse_events((await post(client, {**HELLO, "stream": True})).text)
    text = "".join(d["delta"]["text"] for n, d in deltas if n == "content_block_delta")
    assert text == "Hello, world!"
    start = events["message_start"]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["output_tokens"] == 0
    assert events["content_block_start"] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    final = events["message_delta"]
    assert final["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert final["usage"]["output_tokens"] == 4
    assert final["usage"]["input_tokens"] == start["usage"]["input_tokens"]
    assert events["message_stop"] == {"type": "message_stop"}


async def test_a_streamed_message_that_hits_max_tokens_says_so_in_message_delta(
    client: httpx.AsyncClient,
) -> None:
    events = dict(sse_events((await post(client, {**HELLO, "max_tokens": 1, "stream": True})).text))
    assert events["message_delta"]["delta"]["stop_reason"] == "max_tokens"


async def test_an_empty_answer_streams_one_empty_text_block(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    client = client_of(make_app(ScriptedEngine([])))
    events = sse_events((await post(client, {**HELLO, "stream": True})).text)
    assert [name for name, _ in events] == [
        "message_start",
        "content_block_start",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]


async def test_a_stalled_stream_sends_ping_events_as_keep_alives(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    engine = ScriptedEngine(["a", "b"], stall_after=1, stall_s=0.3)
    client = client_of(make_app(engine, heartbeat_s=0.05))
    response = await post(client, {**HELLO, "stream": True})
    events = sse_events(response.text)
    assert events.count(("ping", {"type": "ping"})) >= 2
    assert ": keep-alive" not in response.text
    assert events[-1][0] == "message_stop"


async def test_an_error_after_the_stream_opened_is_one_error_event_and_nothing_after(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    client = client_of(make_app(ScriptedEngine(["a", "b", "c"], fail_after=2)))
    events = sse_events((await post(client, {**HELLO, "stream": True})).text)
    name, data = events[-1]
    assert name == "error"
    assert data == {
        "type": "error",
        "error": {"type": "api_error", "message": "scripted failure"},
    }
    assert [n for n, _ in events].count("error") == 1


# ---- request translation ----------------------------------------------------------------------


async def test_system_blocks_and_leading_system_messages_become_one_leading_system_turn(
    engine: ScriptedEngine, client: httpx.AsyncClient
) -> None:
    body = {
        **HELLO,
        "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "system", "content": "Answer in French."},
            {"role": "user", "content": "hi"},
        ],
    }
    assert (await post(client, body)).status_code == 200
    prompt = rendered_prompt(engine)
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\nAnswer in French.<|im_end|>")
    assert prompt.count("<|im_start|>system") == 1


async def test_tool_use_and_tool_result_blocks_render_as_assistant_and_tool_turns(
    engine: ScriptedEngine, client: httpx.AsyncClient
) -> None:
    body = {
        **HELLO,
        "tools": [{"name": "weather", "input_schema": {"type": "object"}}],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "I should call it.", "signature": ""},
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "P"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "Sunny, 21C"},
                    {"type": "text", "text": "Thanks!"},
                ],
            },
        ],
    }
    assert (await post(client, body)).status_code == 200
    prompt = rendered_prompt(engine)
    turns = [
        # the scripted template renders no tools: the built-in tool prompt's shapes
        '<|im_start|>assistant\nLet me look.\n<tool_call>\n{"name": "weather", "arguments": '
        '{"city": "P"}}\n</tool_call><|im_end|>',
        "<|im_start|>user\n<tool_response>\nSunny, 21C\n</tool_response><|im_end|>",
        "<|im_start|>user\nThanks!<|im_end|>",
    ]
    positions = [prompt.index(turn) for turn in turns]
    assert positions == sorted(positions)


async def test_temperature_top_p_and_top_k_reach_the_sampler(
    engine: ScriptedEngine, client: httpx.AsyncClient
) -> None:
    body = {**HELLO, "temperature": 0.3, "top_p": 0.8, "top_k": 5}
    assert (await post(client, body)).status_code == 200
    params = engine.submissions[-1].params
    assert (params.temperature, params.top_p, params.top_k) == (0.3, 0.8, 5)


async def test_max_tokens_and_stop_sequences_reach_the_engine(
    engine: ScriptedEngine, client: httpx.AsyncClient
) -> None:
    assert (await post(client, {**HELLO, "max_tokens": 3, "stop_sequences": ["x"]})).is_success
    params = engine.submissions[-1].params
    assert (params.max_tokens, params.stop) == (3, ("x",))


async def test_metadata_cache_control_and_unknown_fields_are_accepted(
    client: httpx.AsyncClient,
) -> None:
    body = {
        **HELLO,
        "metadata": {"user_id": "u1"},
        "service_tier": "auto",
        "some_future_field": {"x": 1},
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}],
            }
        ],
    }
    response = await post(client, body)
    assert response.status_code == 200
    assert response.json()["content"][0]["text"] == "Hello, world!"


# ---- errors -----------------------------------------------------------------------------------


async def test_an_image_block_is_a_400_in_the_anthropic_error_envelope(
    client: httpx.AsyncClient,
) -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    body = {**HELLO, "stream": True, "messages": [{"role": "user", "content": [image]}]}
    response = await post(client, body)
    assert response.status_code == 400
    error = response.json()
    assert error["type"] == "error"
    assert error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"] == "model has no vision sidecar"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"max_tokens": 5}, "messages: at least one message is required"),
        ({**HELLO, "messages": "hi"}, "messages: at least one message is required"),
        ({**HELLO, "max_tokens": "5"}, "max_tokens must be of type int"),
        ({**HELLO, "max_tokens": 0}, "max_tokens must be at least 1"),
        ({**HELLO, "temperature": "hot"}, "temperature must be of type float"),
        ({**HELLO, "stop_sequences": "x"}, "stop_sequences must be a list of strings"),
        ({**HELLO, "system": 5}, "system must be a string or a list of text blocks"),
        (
            {**HELLO, "messages": [{"role": "robot", "content": "hi"}]},
            "messages[0].role must be one of 'user', 'assistant', 'system'",
        ),
        (
            {**HELLO, "messages": [{"role": "user", "content": [{"type": "hologram"}]}]},
            "messages[0].content[0] has an unsupported type 'hologram'",
        ),
    ],
)
async def test_a_malformed_body_is_a_400_in_the_anthropic_error_envelope(
    client: httpx.AsyncClient, body: dict[str, Any], message: str
) -> None:
    response = await post(client, body)
    assert response.status_code == 400
    error = response.json()
    assert error["type"] == "error"
    assert error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"] == message


async def test_a_body_that_is_not_json_is_a_400_in_the_anthropic_error_envelope(
    client: httpx.AsyncClient,
) -> None:
    response = await client.post("/v1/messages", content=b"{not json")
    assert response.status_code == 400
    assert response.json() == {
        "type": "error",
        "error": {"message": "invalid JSON body", "type": "invalid_request_error"},
    }


async def test_a_client_that_leaves_a_message_gets_a_499_in_the_anthropic_envelope(
    make_app: AppFactory,
) -> None:
    engine = ScriptedEngine(["tok"] * 10_000, step_s=0.005)
    app = make_app(engine)
    sent: list[dict[str, Any]] = []
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": json.dumps(HELLO).encode()}
        await asyncio.sleep(0.05)  # leave while the answer is being generated
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/messages",
        "raw_path": b"/v1/messages",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
        "server": ("testserver", 80),
        "client": ("127.0.0.1", 1234),
    }
    await asyncio.wait_for(app(scope, receive, send), timeout=5)
    assert sent[0]["status"] == 499
    assert json.loads(sent[1]["body"]) == {
        "type": "error",
        "error": {
            "message": "request cancelled",
            "type": "invalid_request_error",
            "code": "request_cancelled",
        },
    }
    assert engine.num_cancelled == 1


# ---- count_tokens -----------------------------------------------------------------------------


async def test_count_tokens_matches_the_input_tokens_a_message_reports(
    client: httpx.AsyncClient,
) -> None:
    body = {**HELLO, "system": "Be brief."}
    counted = await client.post("/v1/messages/count_tokens", json=body)
    assert counted.status_code == 200
    answered = (await post(client, body)).json()
    assert counted.json() == {"input_tokens": answered["usage"]["input_tokens"]}


async def test_count_tokens_of_a_malformed_body_is_a_400_in_the_anthropic_envelope(
    client: httpx.AsyncClient,
) -> None:
    response = await client.post("/v1/messages/count_tokens", json={"messages": []})
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
