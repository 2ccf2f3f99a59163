"""A client that leaves stops its transcription: the server logs 499 and decodes no further
segment."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from audio_files import ENGLISH
from live_server import LiveServer
from scripted_whisper import ScriptedWhisper, stage_over

from modelhost.server.app import create_app
from modelhost.server.settings import ServeSettings

FIVE_SEGMENTS = [" one", " two", " three", " four", " five"]


@pytest.fixture
def gate() -> threading.Event:
    return threading.Event()


@pytest.fixture
def model(gate: threading.Event) -> ScriptedWhisper:
    return ScriptedWhisper(list(FIVE_SEGMENTS), gate)


@pytest.fixture
def server(model: ScriptedWhisper) -> Iterator[LiveServer]:
    live = LiveServer(create_app(stage_over(model), ServeSettings())).start()  # type: ignore[arg-type]
    yield live
    live.stop()


def upload() -> dict[str, tuple[str, bytes, str]]:
    return {"file": ("speech.ogg", ENGLISH.read_bytes(), "audio/ogg")}


def wait_until(condition: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline
        time.sleep(0.02)


def logged_499(caplog: pytest.LogCaptureFixture) -> bool:
    return any(" 499 " in record.getMessage() for record in caplog.records)


def test_a_client_that_leaves_a_stream_stops_the_decoding(
    server: LiveServer,
    model: ScriptedWhisper,
    gate: threading.Event,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="modelhost.server")
    url = f"{server.base_url}/v1/audio/transcriptions"
    with (
        httpx.Client(timeout=10) as client,
        client.stream("POST", url, data={"stream": "true"}, files=upload()) as response,
    ):
        first = next(response.iter_lines())
        assert "transcript.text.delta" in first
    wait_until(lambda: logged_499(caplog))
    gate.set()
    wait_until(lambda: model.running == 0)
    assert model.pulled == 2  # the segment in flight when the client left, and no more


def test_a_client_that_stops_waiting_for_json_stops_the_decoding(
    server: LiveServer,
    model: ScriptedWhisper,
    gate: threading.Event,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="modelhost.server")
    url = f"{server.base_url}/v1/audio/transcriptions"
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url, files=upload(), timeout=httpx.Timeout(10, read=0.5))
    wait_until(lambda: logged_499(caplog))
    gate.set()
    wait_until(lambda: model.running == 0)
    assert model.pulled == 2
