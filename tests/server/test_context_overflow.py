"""A prompt longer than the context window, on every surface, over a scripted engine: each
client is refused in its own words (the words coding agents act on), Ollama trims as Ollama
does, and `--context-overflow truncate` makes every surface trim instead of refusing."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import anthropic
import httpx
import openai
import pytest
from scripted_engine import ScriptedEngine, scripted_model
from starlette.applications import Starlette

from modelhost.models.loaded import LoadedModel

AppFactory = Callable[..., Starlette]
ClientFactory = Callable[[Starlette], httpx.AsyncClient]
WINDOW = 16
HELLO: list[Any] = [{"role": "user", "content": "hi"}]


def chat_tokens(model: LoadedModel, messages: Sequence[Any]) -> int:
    """The prompt tokens `messages` render to through the model's template."""
    text = model.tokenizer.render_chat(messages, add_generation_prompt=True)
    return len(model.tokenizer.encode(text, add_special_tokens=False))


@pytest.fixture
def small() -> LoadedModel:
    return scripted_model(context_length=WINDOW)


@pytest.fixture
def small_client(
    make_app: AppFactory, client_of: ClientFactory, small: LoadedModel
) -> httpx.AsyncClient:
    return client_of(make_app(ScriptedEngine(), small))


# ---- OpenAI -------------------------------------------------------------------------------------


def test_the_openai_sdk_reads_an_oversize_chat_prompt_as_context_length_exceeded_on_messages(
    make_app: AppFactory, live_server: Any, small: LoadedModel
) -> None:
    server = live_server(make_app(ScriptedEngine(), small))
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
    with client, pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="scripted-model", messages=HELLO)
    assert refused.value.code == "context_length_exceeded"
    assert refused.value.param == "messages"
    assert refused.value.body == {
        "message": f"This model's maximum context length is {WINDOW} tokens. However, your "
        f"messages resulted in {chat_tokens(small, HELLO)} tokens. Please reduce the length of "
        "the messages.",
        "type": "invalid_request_error",
        "param": "messages",
        "code": "context_length_exceeded",
    }


async def test_an_oversize_streamed_chat_prompt_is_refused_before_the_stream_opens(
    small_client: httpx.AsyncClient,
) -> None:
    response = await small_client.post(
        "/v1/chat/completions", json={"messages": HELLO, "stream": True}
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"


async def test_an_oversize_completions_prompt_is_context_length_exceeded_on_prompt(
    small_client: httpx.AsyncClient,
) -> None:
    prompt = "x" * (WINDOW + 4)
    response = await small_client.post("/v1/completions", json={"prompt": prompt})
    assert response.status_code == 400
    assert response.json() == {
        "error": {
            "message": f"This model's maximum context length is {WINDOW} tokens. However, your "
            f"prompt resulted in {WINDOW + 4} tokens. Please reduce the length of the prompt.",
            "type": "invalid_request_error",
            "param": "prompt",
            "code": "context_length_exceeded",
        }
    }


async def test_an_oversize_responses_input_is_context_length_exceeded_on_input(
    small_client: httpx.AsyncClient, small: LoadedModel
) -> None:
    response = await small_client.post("/v1/responses", json={"input": "hi"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["code"], error["param"], error["type"]) == (
        "context_length_exceeded",
        "input",
        "invalid_request_error",
    )
    prompt_tokens = chat_tokens(small, HELLO)
    assert f"maximum context length is {WINDOW} tokens" in error["message"]
    assert f"your input resulted in {prompt_tokens} tokens" in error["message"]


def test_a_responses_stream_that_fails_after_its_head_names_context_length_exceeded() -> None:
    from modelhost.inference.contracts import ContextOverBudget
    from modelhost.server.responses.routes import ResponseStream, parse_turn
    from modelhost.server.responses.store import ResponseStore

    turn = parse_turn({"input": "hi"}, lambda _: None, "resp_1")
    stream = ResponseStream(turn, ResponseStore())
    refusal = ContextOverBudget("too long", 40, WINDOW)
    [frame] = stream.error(refusal.status, refusal.body)
    assert frame.startswith("event: response.failed\n")
    assert '"code":"context_length_exceeded"' in frame.replace(" ", "")


# ---- Anthropic ----------------------------------------------------------------------------------


def test_the_anthropic_sdk_reads_an_oversize_prompt_as_prompt_is_too_long(
    make_app: AppFactory, live_server: Any, small: LoadedModel
) -> None:
    server = live_server(make_app(ScriptedEngine(), small))
    client = anthropic.Anthropic(base_url=server.base_url, api_key="none", max_retries=0)
    with client, pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model="scripted-model", max_tokens=8, messages=HELLO)
    prompt_tokens = chat_tokens(small, HELLO)
    assert f"prompt is too long: {prompt_tokens} tokens > {WINDOW} maximum" in str(refused.value)


async def test_an_oversize_anthropic_prompt_has_exactly_anthropics_error_body(
    small_client: httpx.AsyncClient, small: LoadedModel
) -> None:
    body = {"model": "scripted-model", "max_tokens": 8, "messages": HELLO, "stream": True}
    response = await small_client.post("/v1/messages", json=body)
    assert response.status_code == 400
    prompt_tokens = chat_tokens(small, HELLO)
    assert response.json() == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": f"prompt is too long: {prompt_tokens} tokens > {WINDOW} maximum",
        },
    }


async def test_a_prompt_that_fits_but_not_with_its_max_tokens_is_clamped_not_refused(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    model = scripted_model(context_length=40)
    client = client_of(make_app(ScriptedEngine(), model))
    body = {"model": "scripted-model", "max_tokens": 1000, "messages": HELLO}
    response = await client.post("/v1/messages", json=body)
    assert response.status_code == 200
    assert response.json()["usage"]["input_tokens"] == chat_tokens(model, HELLO)


# ---- Ollama -------------------------------------------------------------------------------------

SYSTEM = {"role": "system", "content": "Be brief."}
HISTORY: list[Any] = [
    SYSTEM,
    {"role": "user", "content": "the oldest question " * 8},
    {"role": "assistant", "content": "an old answer " * 8},
    {"role": "user", "content": "a later question " * 8},
    {"role": "assistant", "content": "a later answer " * 8},
    {"role": "user", "content": "the newest question"},
]


def submitted_text(engine: ScriptedEngine, model: LoadedModel) -> str:
    return model.tokenizer.decode(engine.submissions[-1].prompt_ids, skip_special_tokens=False)


async def test_ollama_trims_the_oldest_turns_and_keeps_the_system_message(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    window = 200
    model, engine = scripted_model(context_length=window), ScriptedEngine()
    assert chat_tokens(model, HISTORY) > window
    client = client_of(make_app(engine, model))
    body = {"model": "scripted-model", "messages": HISTORY, "stream": False}
    response = await client.post("/api/chat", json=body)
    assert response.status_code == 200
    reply = response.json()
    assert reply["prompt_eval_count"] <= window
    assert reply["prompt_eval_count"] == len(engine.submissions[-1].prompt_ids)
    prompt = submitted_text(engine, model)
    assert "Be brief." in prompt and "the newest question" in prompt
    assert "the oldest question" not in prompt


async def test_ollama_generate_keeps_the_end_of_an_oversize_prompt(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    window = 64
    model, engine = scripted_model(context_length=window), ScriptedEngine()
    client = client_of(make_app(engine, model))
    prompt = "a" * 200 + "THE END"
    body = {"model": "scripted-model", "prompt": prompt, "system": "Be brief.", "stream": False}
    response = await client.post("/api/generate", json=body)
    assert response.status_code == 200
    assert response.json()["prompt_eval_count"] <= window
    text = submitted_text(engine, model)
    assert "Be brief." in text and "THE END" in text


async def test_ollama_with_truncate_false_refuses_in_its_own_shape_naming_both_sizes(
    small_client: httpx.AsyncClient, small: LoadedModel
) -> None:
    body = {"model": "scripted-model", "messages": HELLO, "truncate": False, "stream": False}
    response = await small_client.post("/api/chat", json=body)
    assert response.status_code == 400
    prompt_tokens = chat_tokens(small, HELLO)
    assert response.json() == {
        "error": "the input length exceeds the context length: the prompt is "
        f"{prompt_tokens} tokens and the context length is {WINDOW}"
    }


# ---- --context-overflow truncate ----------------------------------------------------------------


async def test_context_overflow_truncate_makes_the_openai_surface_answer_a_trimmed_prompt(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    window = 200
    model, engine = scripted_model(context_length=window), ScriptedEngine()
    client = client_of(make_app(engine, model, context_overflow="truncate"))
    response = await client.post("/v1/chat/completions", json={"messages": HISTORY})
    assert response.status_code == 200
    assert response.json()["usage"]["prompt_tokens"] <= window
    assert response.headers["warning"].startswith("prompt truncated to fit the context window")
    prompt = submitted_text(engine, model)
    assert "Be brief." in prompt and "the newest question" in prompt


async def test_without_context_overflow_truncate_the_openai_surface_refuses_the_same_prompt(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    client = client_of(make_app(ScriptedEngine(), scripted_model(context_length=200)))
    response = await client.post("/v1/chat/completions", json={"messages": HISTORY})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"
