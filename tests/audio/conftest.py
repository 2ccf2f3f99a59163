"""Fixtures for transcription: Whisper base loaded once per session, served on a free port."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from live_server import LiveServer
from openai import OpenAI

from modelhost.audio.transcriber import TranscriptionStage, load_transcriber
from modelhost.audio.whisper_files import WHISPER_BASE, whisper_base_dir
from modelhost.server.app import create_app
from modelhost.server.settings import ServeSettings


@pytest.fixture(scope="session")
def whisper_dir() -> Path:
    return whisper_base_dir()


@pytest.fixture(scope="session")
def transcriber(whisper_dir: Path) -> Iterator[TranscriptionStage]:
    # The suite runs torch on one thread; Whisper gets both cores for its own requests.
    stage = load_transcriber(whisper_dir, WHISPER_BASE, cpu_threads=2)
    yield stage
    stage.close()


@pytest.fixture(scope="session")
def server(transcriber: TranscriptionStage) -> Iterator[LiveServer]:
    """The single-model app over the Whisper stage, as `modelhost serve` would build it."""
    app = create_app(transcriber, ServeSettings(close_engine_on_shutdown=False))  # type: ignore[arg-type]
    with LiveServer(app) as live:
        yield live


@pytest.fixture
def client(server: LiveServer) -> Iterator[OpenAI]:
    with OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0) as sdk:
        yield sdk
