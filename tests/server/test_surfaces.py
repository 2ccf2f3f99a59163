"""The registry of protocol surfaces: what each routed path needs of its model, which error
shape each path answers in, and a protocol added by one module and one entry."""

from __future__ import annotations

from collections.abc import AsyncIterator

import echo_surface
import httpx
import pytest
from routed_world import RoutedWorld

from modelhost.server.anthropic.wire import ANTHROPIC_ERRORS
from modelhost.server.app import create_routed_app
from modelhost.server.openai.wire import OPENAI_ERRORS
from modelhost.server.responses.wire import RESPONSES_ERRORS
from modelhost.server.settings import ServeSettings
from modelhost.server.surfaces import SURFACES, Surfaces

KEY = "echo-key"


def test_each_routed_path_needs_its_own_operation():
    assert SURFACES.operation("/v1/chat/completions") == "generate"
    assert SURFACES.operation("/v1/embeddings") == "embed"
    assert SURFACES.operation("/v1/audio/transcriptions") == "transcribe"
    assert SURFACES.operation("/v1/audio/translations") == "transcribe"
    assert SURFACES.operation("/v1/models") is None


def test_a_path_answers_in_the_error_shape_of_the_surface_it_belongs_to():
    assert SURFACES.errors_for("/v1/messages") is ANTHROPIC_ERRORS
    assert SURFACES.errors_for("/v1/messages/count_tokens") is ANTHROPIC_ERRORS
    assert SURFACES.errors_for("/v1/responses/resp_123") is RESPONSES_ERRORS
    assert SURFACES.errors_for("/v1/chat/completions") is OPENAI_ERRORS
    assert SURFACES.errors_for("/api/jobs") is OPENAI_ERRORS  # no surface: OpenAI's


@pytest.fixture
async def echo_world() -> AsyncIterator[tuple[RoutedWorld, httpx.AsyncClient]]:
    world = RoutedWorld({"a": 1, "b": 1}, budget_mb=10)
    surfaces = Surfaces((*SURFACES.surfaces, echo_surface.SURFACE))
    settings = ServeSettings(api_key=KEY, max_body_bytes=2048)
    app = create_routed_app(world.router, settings, surfaces=surfaces)
    headers = {"authorization": f"Bearer {KEY}"}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
        client.headers.update(headers)
        yield world, client


async def test_an_added_surface_is_routed_by_the_bodys_model_and_served_by_that_model(echo_world):
    world, client = echo_world
    answer = await client.post("/v1/echo", json={"model": "b", "text": "hi"})
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"model": "b", "echo": "[b]"}
    assert world.loads == ["b"]


async def test_an_added_surface_is_listed_among_the_endpoints(echo_world):
    _, client = echo_world
    assert "/v1/echo" in (await client.get("/v1")).json()["endpoints"]


async def test_an_added_surface_is_refused_at_the_edge_in_its_own_error_shape(echo_world):
    _, client = echo_world
    keyless = await client.post("/v1/echo", json={"text": "hi"}, headers={"authorization": ""})
    assert keyless.status_code == 401
    assert keyless.json()["oops"]["code"] == "missing_api_key"
    too_big = await client.post("/v1/echo", json={"text": "x" * 4096})
    assert too_big.status_code == 413
    assert too_big.json()["oops"]["code"] == "request_too_large"
