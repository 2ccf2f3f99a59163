"""Fixtures for the reliability tests: apps over a scripted engine, in-process clients, and a
real uvicorn server on a free loopback port."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import pytest
from live_server import LiveServer
from reliability_support import AppFactory, ClientFactory
from scripted_engine import ScriptedEngine, scripted_model
from starlette.applications import Starlette

from modelhost.assembly import build_app
from modelhost.server.settings import ServeSettings


@pytest.fixture
def make_app() -> AppFactory:
    """`make_app(engine=None, **settings)`: an app over a scripted engine."""

    def make(engine: ScriptedEngine | None = None, **settings: Any) -> Starlette:
        return build_app(engine or ScriptedEngine(), scripted_model(), ServeSettings(**settings))

    return make


@pytest.fixture
async def client_of() -> AsyncIterator[ClientFactory]:
    """`client_of(app, **client_options)`: an httpx client calling `app` in-process."""
    clients: list[httpx.AsyncClient] = []

    def open_client(app: Starlette, **options: Any) -> httpx.AsyncClient:
        transport = httpx.ASGITransport(app=app)
        options.setdefault("base_url", "http://testserver")
        clients.append(httpx.AsyncClient(transport=transport, **options))
        return clients[-1]

    yield open_client
    for client in clients:
        await client.aclose()


@pytest.fixture
def live_server() -> Iterator[Callable[[Starlette], LiveServer]]:
    """`live_server(app)`: a started LiveServer, stopped after the test."""
    servers: list[LiveServer] = []

    def start(app: Starlette) -> LiveServer:
        servers.append(LiveServer(app).start())
        return servers[-1]

    yield start
    for server in servers:
        server.stop()
