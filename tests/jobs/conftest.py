"""Fixtures for the job tests: a private MODELHOST_HOME, and live servers whose job host also
knows the test kinds."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from job_helpers import scripted_app
from live_server import LiveServer
from starlette.applications import Starlette


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh MODELHOST_HOME for the job store; converted-model caches stay shared, so a
    model the suite already converted loads warm."""
    suite_cache = Path(os.environ["MODELHOST_HOME"]) / "cache"
    suite_cache.mkdir(parents=True, exist_ok=True)
    home = tmp_path / "home"
    home.mkdir()
    (home / "cache").symlink_to(suite_cache.resolve())
    monkeypatch.setenv("MODELHOST_HOME", str(home))
    return home


@pytest.fixture
def live_app() -> Iterator[Callable[..., LiveServer]]:
    """`live_app(app=None)`: a started server (a scripted engine by default), stopped after."""
    servers: list[LiveServer] = []

    def start(app: Starlette | None = None) -> LiveServer:
        server = LiveServer(app or scripted_app()).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def server(live_app: Callable[..., LiveServer]) -> LiveServer:
    return live_app()
