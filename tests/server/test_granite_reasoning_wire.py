"""Granite 3.3's reasoning form, `<think>…</think><response>…</response>`, as a scripted Granite
model with Granite 3.3's template writes it: the thinking comes back as reasoning on every
surface, streamed or not, and neither the think nor the response tags reach the content."""

from __future__ import annotations

from collections.abc import Callable

import httpx
from family_templates import template
from scripted_engine import ScriptedEngine, scripted_model
from sse_payloads import sse_data
from starlette.applications import Starlette

AppFactory = Callable[..., Starlette]
ClientFactory = Callable[[Starlette], httpx.AsyncClient]

# The tags arrive split across tokens, as a real tokenizer would split them.
SCRIPT = ("<think>", "1 plus 1", " is 2.", "</think>", "\n<resp", "onse>", "It is", " 2.",
          "</response>")  # fmt: skip
TAGS = ("<think>", "</think>", "<response>", "</response>", "<resp")
USER = [{"role": "user", "content": "What is 1+1?"}]


def granite_app(make_app: AppFactory) -> tuple[Starlette, ScriptedEngine]:
    engine = ScriptedEngine(SCRIPT)
    model = scripted_model(family="granite", template=template("granite3_3"))
    return make_app(engine, model), engine


def clean(text: str | None) -> bool:
    return not any(tag in (text or "") for tag in TAGS)


async def test_chat_returns_the_thinking_as_reasoning_and_the_response_as_content(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    app, _ = granite_app(make_app)
    body = {"model": "m", "messages": USER, "chat_template_kwargs": {"enable_thinking": True}}

    message = (await client_of(app).post("/v1/chat/completions", json=body)).json()

    choice = message["choices"][0]
    assert choice["message"]["reasoning"] == "1 plus 1 is 2."
    assert choice["message"]["content"] == "It is 2."
    assert choice["finish_reason"] == "stop"


async def test_the_thinking_switch_reaches_granites_template_as_its_own_variable(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    app, engine = granite_app(make_app)
    body = {"model": "m", "messages": USER, "chat_template_kwargs": {"enable_thinking": True}}

    await client_of(app).post("/v1/chat/completions", json=body)

    prompt = scripted_model().tokenizer.decode(engine.submissions[-1].prompt_ids, False)
    assert "write your response between <response></response>" in prompt


async def test_chat_streams_reasoning_and_content_deltas_with_no_tags(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    app, _ = granite_app(make_app)
    body = {"model": "m", "messages": USER, "stream": True}

    response = await client_of(app).post("/v1/chat/completions", json=body)

    deltas = [chunk["choices"][0]["delta"] for chunk in sse_data(response.text)]
    assert all(clean(d.get("content")) and clean(d.get("reasoning")) for d in deltas)
    reasoning = "".join(delta.get("reasoning") or "" for delta in deltas)
    content = "".join(delta.get("content") or "" for delta in deltas)
    assert (reasoning, content) == ("1 plus 1 is 2.", "It is 2.")


async def test_anthropic_answers_a_thinking_block_then_a_text_block_without_tags(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    app, _ = granite_app(make_app)
    body = {"model": "m", "max_tokens": 64, "messages": USER}

    message = (await client_of(app).post("/v1/messages", json=body)).json()

    assert [block["type"] for block in message["content"]] == ["thinking", "text"]
    assert message["content"][0]["thinking"] == "1 plus 1 is 2."
    assert message["content"][1]["text"] == "It is 2."


async def test_anthropic_streams_the_thinking_and_the_text_without_tags(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    app, _ = granite_app(make_app)
    body = {"model": "m", "max_tokens": 64, "messages": USER, "stream": True}

    events = sse_data((await client_of(app).post("/v1/messages", json=body)).text)

    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    thinking = "".join(d.get("thinking", "") for d in deltas)
    text = "".join(d.get("text", "") for d in deltas)
    assert (thinking, text) == ("1 plus 1 is 2.", "It is 2.")


async def test_responses_output_a_reasoning_item_and_a_message_without_tags(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    app, _ = granite_app(make_app)
    body = {"model": "m", "input": "What is 1+1?", "stream": True}

    response = await client_of(app).post("/v1/responses", json=body)

    output = sse_data(response.text)[-1]["response"]["output"]
    assert [item["type"] for item in output] == ["reasoning", "message"]
    assert output[0]["summary"] == [{"type": "summary_text", "text": "1 plus 1 is 2."}]
    assert output[1]["content"][0]["text"] == "It is 2."
