"""Fixtures for the HTTP surfaces: an app over a scripted engine, an in-process client, and a
real uvicorn server on a free loopback port."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import pytest
from live_server import LiveServer
from scripted_engine import ScriptedEngine, scripted_model
from starlette.applications import Starlette

from modelhost.assembly import build_app
from modelhost.models.loaded import LoadedModel
from modelhost.server.settings import ServeSettings

AppFactory = Callable[..., Starlette]
ClientFactory = Callable[[Starlette], httpx.AsyncClient]


def _make_app(
    engine: ScriptedEngine | None = None,
    model: LoadedModel | None = None,
    **settings: Any,
) -> Starlette:
    settings.setdefault("heartbeat_s", 15.0)
    return build_app(
        engine or ScriptedEngine(), model or scripted_model(), ServeSettings(**settings)
    )


@pytest.fixture
def make_app() -> AppFactory:
    """`make_app(engine=None, model=None, **settings)`: an app over a scripted engine."""
    return _make_app


@pytest.fixture
async def client_of() -> AsyncIterator[ClientFactory]:
    """`client_of(app)`: an httpx client calling `app` in-process, closed after the test."""
    clients: list[httpx.AsyncClient] = []

    def open_client(app: Starlette) -> httpx.AsyncClient:
        transport = httpx.ASGITransport(app=app)
        clients.append(httpx.AsyncClient(transport=transport, base_url="http://testserver"))
        return clients[-1]

    yield open_client
    for client in clients:
        await client.aclose()


@pytest.fixture
def engine() -> ScriptedEngine:
    return ScriptedEngine()


@pytest.fixture
def app(engine: ScriptedEngine) -> Starlette:
    return _make_app(engine)


@pytest.fixture
def client(app: Starlette, client_of: ClientFactory) -> httpx.AsyncClient:
    return client_of(app)


@pytest.fixture
def live_server() -> Iterator[Callable[..., LiveServer]]:
    """`live_server(app, shutdown_timeout_s=5.0)`: a started LiveServer, stopped after the test."""
    servers: list[LiveServer] = []

    def start(app: Starlette, *, shutdown_timeout_s: float = 5.0) -> LiveServer:
        server = LiveServer(app, shutdown_timeout_s=shutdown_timeout_s).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def module_live_server() -> Iterator[Callable[..., LiveServer]]:
    """As `live_server`, for servers shared by a module's tests (a real model loads once)."""
    servers: list[LiveServer] = []

    def start(app: Starlette, *, shutdown_timeout_s: float = 5.0) -> LiveServer:
        server = LiveServer(app, shutdown_timeout_s=shutdown_timeout_s).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()
