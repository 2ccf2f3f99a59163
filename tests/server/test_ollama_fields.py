"""Each of Ollama's request fields the official `ollama` client sends, as the engine receives it
(a scripted engine records every row it is given), and the edge's refusals (Host guard,
admission queue, context) in Ollama's `{"error"}` shape."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import ollama
import pytest
from scripted_engine import ScriptedEngine, scripted_model
from starlette.applications import Starlette

from modelhost.engine.sampling.sampling_params import SamplingParams

AppFactory = Callable[..., Starlette]
ClientFactory = Callable[[Starlette], httpx.AsyncClient]
MODEL = "scripted-model"
ASK = [{"role": "user", "content": "Hi"}]
# Every sampler option Ollama documents that this server maps, at a value that is not its default.
SAMPLER_OPTIONS: dict[str, Any] = {
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 12,
    "min_p": 0.05,
    "num_predict": 3,
    "seed": 42,
    "stop": ["END", "STOP"],
    "repeat_penalty": 1.2,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.25,
}
# Options of Ollama's own runner, and num_ctx: accepted, nothing to map.
RUNNER_OPTIONS: dict[str, Any] = {
    "num_ctx": 4096,
    "num_gpu": 99,
    "num_thread": 4,
    "num_batch": 512,
    "use_mmap": True,
    "repeat_last_n": 64,
    "num_keep": 4,
    "mirostat": 0,
    "typical_p": 1.0,
}


@pytest.fixture
def scripted(
    make_app: AppFactory, live_server: Any
) -> Iterator[tuple[ollama.Client, ScriptedEngine, str]]:
    engine = ScriptedEngine(("<think>", "Plan.", "</think>", "Done", "."))
    server = live_server(make_app(engine, scripted_model(family="qwen3")))
    with ollama.Client(host=server.base_url) as client:
        yield client, engine, server.base_url


def sent(engine: ScriptedEngine) -> SamplingParams:
    return engine.submissions[-1].params


def sampler_fields(params: SamplingParams) -> dict[str, Any]:
    return {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "min_p": params.min_p,
        "num_predict": params.max_tokens,
        "seed": params.seed,
        "stop": list(params.stop),
        "repeat_penalty": params.repetition_penalty,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
    }


def test_every_sampler_option_of_a_chat_reaches_the_engine(scripted: Any) -> None:
    client, engine, _ = scripted
    client.chat(model=MODEL, messages=ASK, options={**SAMPLER_OPTIONS, **RUNNER_OPTIONS})
    assert sampler_fields(sent(engine)) == SAMPLER_OPTIONS


def test_every_sampler_option_of_a_generate_reaches_the_engine_streamed(scripted: Any) -> None:
    client, engine, _ = scripted
    list(client.generate(model=MODEL, prompt="Hi", options=SAMPLER_OPTIONS, stream=True))
    assert sampler_fields(sent(engine)) == SAMPLER_OPTIONS


def test_options_as_the_clients_typed_options_object_reach_the_engine(scripted: Any) -> None:
    client, engine, _ = scripted
    client.chat(model=MODEL, messages=ASK, options=ollama.Options(top_k=5, seed=3, num_ctx=2048))
    assert (sent(engine).top_k, sent(engine).seed) == (5, 3)


def test_think_on_generate_gives_the_thinking_field_streamed_and_not(scripted: Any) -> None:
    client, _, _ = scripted
    whole = client.generate(model=MODEL, prompt="Hi", think=True)
    assert (whole.thinking, whole.response) == ("Plan.", "Done.")
    parts = list(client.generate(model=MODEL, prompt="Hi", think=True, stream=True))
    assert "".join(p.thinking or "" for p in parts) == "Plan."
    assert "".join(p.response for p in parts) == "Done."


def test_think_takes_an_effort_level(scripted: Any) -> None:
    client, _, _ = scripted
    reply = client.chat(model=MODEL, messages=ASK, think="high")
    assert reply.message.thinking == "Plan." and reply.message.content == "Done."


@pytest.mark.parametrize(
    ("body", "words"), [({"top_logprobs": 21}, "top_logprobs"), ({"logprobs": "yes"}, "logprobs")]
)
def test_logprobs_fields_out_of_range_are_400s_naming_them(
    scripted: Any, body: dict[str, Any], words: str
) -> None:
    _, engine, base_url = scripted
    response = httpx.post(
        f"{base_url}/api/chat",
        json={"model": MODEL, "messages": ASK, "stream": False, **body},
    )
    assert response.status_code == 400 and words in response.json()["error"]
    assert engine.submissions == []


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"top_k": -1}, "top_k"),
        ({"top_p": 1.5}, "top_p"),
        ({"num_ctx": 0}, "num_ctx"),
        ({"typical_p": 0.5}, "typical_p"),
        ({"tfs_z": 2.0}, "tfs_z"),
        ({"seed": "x"}, "seed"),
        ({"stop": 7}, "stop"),
    ],
)
def test_an_option_out_of_its_range_is_a_400_naming_it(
    scripted: Any, options: dict[str, Any], words: str
) -> None:
    client, engine, _ = scripted
    with pytest.raises(ollama.ResponseError) as raised:
        client.chat(model=MODEL, messages=ASK, options=options)
    assert raised.value.status_code == 400 and words in raised.value.error
    assert engine.submissions == []


# ---------------------------------------------------------------------------------------------
# The edge, as on every surface


async def test_a_foreign_host_is_refused_in_ollamas_shape(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    client = client_of(make_app(ScriptedEngine(("Hi",))))
    body = {"model": MODEL, "messages": ASK, "stream": False}
    refused = await client.post("/api/chat", json=body, headers={"host": "evil.example"})
    assert refused.status_code == 403 and set(refused.json()) == {"error"}
    listed = await client.get("/api/tags", headers={"host": "evil.example"})
    assert listed.status_code == 403


async def test_a_full_queue_is_a_429_in_ollamas_shape(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    engine = ScriptedEngine(["a"] * 1000, step_s=0.05, batch=1, max_queue=0)
    client = client_of(make_app(engine))
    engine.submit([1], SamplingParams())  # the only slot is taken
    refused = await client.post("/api/chat", json={"model": MODEL, "messages": ASK})
    engine.close()
    assert refused.status_code == 429
    assert refused.json() == {"error": "admission queue is full"}


async def test_a_prompt_beyond_the_context_with_truncate_false_is_a_400_in_ollamas_shape(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    engine = ScriptedEngine(("Hi",), context_length=64)
    client = client_of(make_app(engine, scripted_model(context_length=64)))
    long = [{"role": "user", "content": "word " * 200}]
    refused = await client.post(
        "/api/generate",
        json={"model": MODEL, "prompt": long[0]["content"], "truncate": False},
    )
    assert refused.status_code == 400 and "context" in refused.json()["error"]
    assert engine.submissions == []


def test_the_clients_ollama_host_and_api_key_variables_reach_a_keyed_server(
    make_app: AppFactory, live_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = live_server(make_app(ScriptedEngine(("Hi",)), api_key="sesame"))
    monkeypatch.setenv("OLLAMA_HOST", server.base_url.removeprefix("http://"))
    monkeypatch.setenv("OLLAMA_API_KEY", "sesame")
    with ollama.Client() as client:
        assert client.chat(model=MODEL, messages=ASK).message.content == "Hi"


def test_image_generation_fields_are_a_400_this_model_draws_nothing(scripted: Any) -> None:
    client, engine, _ = scripted
    with pytest.raises(ollama.ResponseError) as raised:
        client.generate(model=MODEL, prompt="a cat", width=512, height=512)
    assert raised.value.status_code == 400
    assert "does not generate images (width, height)" in raised.value.error
    assert engine.submissions == []
