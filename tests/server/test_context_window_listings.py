"""Each model's window where clients read it: OpenAI's `/v1/models` (`context_length`,
`max_model_len`), Anthropic's listing (`max_input_tokens`, `max_tokens`), Ollama's `/api/show`
(`<arch>.context_length`) and `/api/ps` (`context_length`), for resident models and for those
the registry only knows."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Any

import anthropic
import httpx
import pytest
from routed_world import RoutedWorld
from scripted_engine import ScriptedEngine
from starlette.applications import Starlette

AppFactory = Callable[..., Starlette]
ClientFactory = Callable[[Starlette], httpx.AsyncClient]
SCRIPTED_WINDOW = 2048  # scripted_model()'s


async def test_openai_model_rows_give_the_enforced_window_as_context_length_and_max_model_len(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    client = client_of(make_app(context_length=100))
    [row] = (await client.get("/v1/models")).json()["data"]
    assert (row["context_length"], row["max_model_len"]) == (100, 100)


def test_the_anthropic_sdk_lists_each_models_input_and_output_limits(
    make_app: AppFactory, live_server: Any
) -> None:
    server = live_server(make_app(context_length=100))
    with anthropic.Anthropic(base_url=server.base_url, api_key="none", max_retries=0) as client:
        [model] = list(client.models.list())
        retrieved = client.models.retrieve("scripted-model")
    assert (model.id, model.type, model.display_name) == (
        "scripted-model",
        "model",
        "scripted-model",
    )
    assert (model.max_input_tokens, model.max_tokens) == (99, 99)  # a prompt leaves one token
    assert retrieved.max_input_tokens == 99


async def test_ollama_show_of_a_single_model_server_gives_its_window(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    client = client_of(make_app(ScriptedEngine(), context_length=100))
    shown = (await client.post("/api/show", json={"model": "scripted-model"})).json()
    assert shown["model_info"]["llama.context_length"] == 100


@pytest.fixture
async def routed() -> AsyncIterator[tuple[RoutedWorld, httpx.AsyncClient]]:
    """Models "a" and "b"; the registry knows "b" is served at a 4096-token window."""
    world = RoutedWorld({"a": 1, "b": 1}, budget_mb=10)
    known = world.registry.entries_by_id
    known["b"] = dataclasses.replace(known["b"], context_length=4096)
    transport = httpx.ASGITransport(app=world.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
        chat = {"model": "a", "messages": [{"role": "user", "content": "hi"}]}
        assert (await client.post("/v1/chat/completions", json=chat)).status_code == 200
        yield world, client


async def test_model_rows_give_the_registrys_window_for_a_model_not_resident_yet(routed):
    world, client = routed
    rows = {row["id"]: row for row in (await client.get("/v1/models")).json()["data"]}
    assert rows["b"]["resident"] is False
    assert (rows["b"]["context_length"], rows["b"]["max_model_len"]) == (4096, 4096)
    assert rows["a"]["context_length"] == SCRIPTED_WINDOW
    assert world.loads == ["a"]  # listing loaded nothing


async def test_ollama_show_gives_the_window_a_model_would_be_served_at(routed):
    _, client = routed
    shown = (await client.post("/api/show", json={"model": "b"})).json()
    assert shown["model_info"]["llama.context_length"] == 4096


async def test_ollama_ps_gives_each_resident_models_window(routed):
    _, client = routed
    [row] = (await client.get("/api/ps")).json()["models"]
    assert (row["name"], row["context_length"]) == ("a:latest", SCRIPTED_WINDOW)
