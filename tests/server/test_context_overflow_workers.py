"""A prompt over the window through `modelhost serve`'s default process model: the model's
worker process refuses or trims it, and the client still reads the refusal in its own words
(the front relays the worker's JSON), with the real sizes."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from live_server import free_port
from test_serve_process import SERVE, wait_for_health

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
WINDOW = 64
LONG = [{"role": "user", "content": "Tell me about the sea. " * 40}]


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    argv = ["--port", str(port), "--batch", "2", "--context-length", str(WINDOW)]
    log_path = tmp_path_factory.mktemp("overflow") / "serve.log"
    with Path(log_path).open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-c", SERVE, *argv, "--no-spare-worker"], stdout=log, stderr=log
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(url, process)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=60)


def test_a_worker_served_chat_over_the_window_is_openais_context_length_exceeded(
    base_url: str,
) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=120)
    with client, pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=LONG)  # type: ignore[arg-type]
    assert (refused.value.code, refused.value.param) == ("context_length_exceeded", "messages")
    assert f"maximum context length is {WINDOW} tokens" in refused.value.message


def test_a_worker_served_message_over_the_window_is_anthropics_prompt_is_too_long(
    base_url: str,
) -> None:
    with anthropic.Anthropic(base_url=base_url, api_key="none", max_retries=0) as client:
        counted = client.messages.count_tokens(model=MODEL, messages=LONG)  # type: ignore[arg-type]
        with pytest.raises(anthropic.BadRequestError) as refused:
            client.messages.create(model=MODEL, max_tokens=8, messages=LONG)  # type: ignore[arg-type]
    expected = f"prompt is too long: {counted.input_tokens} tokens > {WINDOW} maximum"
    assert expected in str(refused.value)


def test_a_worker_served_ollama_chat_is_trimmed_to_the_window(base_url: str) -> None:
    history = [
        {"role": "system", "content": "Be brief."},
        *LONG,
        {"role": "assistant", "content": "The sea is large."},
        {"role": "user", "content": "Why?"},
    ]
    body = {"model": MODEL, "messages": history, "stream": False, "options": {"num_predict": 2}}
    reply = httpx.post(f"{base_url}/api/chat", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    assert 0 < reply.json()["prompt_eval_count"] <= WINDOW


def test_a_worker_served_models_listing_gives_the_enforced_window(base_url: str) -> None:
    rows = httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"]
    [row] = [row for row in rows if row["id"] == MODEL]
    assert (row["context_length"], row["max_model_len"]) == (WINDOW, WINDOW)
