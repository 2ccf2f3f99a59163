"""Ollama's API through `modelhost serve`'s default process model: the front resolves the name
and the keep-alive, the model's worker process answers, NDJSON streams come through, and the
load the front waited for counts in the worker's load_duration."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import ollama
import pytest
from live_server import free_port
from test_serve_process import SERVE, wait_for_health

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
ASK = [{"role": "user", "content": "Hi"}]


def workers(base_url: str) -> list[object]:
    listed: list[object] = httpx.get(f"{base_url}/engine").json()["workers"]
    return listed


def load_seconds(base_url: str) -> float:
    """The front's total of model load seconds, from its metrics."""
    for row in httpx.get(f"{base_url}/metrics").text.splitlines():
        if row.startswith("modelhost_model_load_seconds_sum"):
            return float(row.split()[-1])
    return 0.0


def test_a_worker_served_model_streams_ndjson_and_goes_with_keep_alive_zero(
    tmp_path: Path,
) -> None:
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    with (tmp_path / "serve.log").open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-c", SERVE, "--port", str(port), "--batch", "2"],
            stdout=log,
            stderr=log,
        )
    try:
        wait_for_health(base_url, process)
        with ollama.Client(host=base_url, timeout=120) as client:
            options = {"temperature": 0, "num_predict": 4}
            whole = client.chat(model=f"{MODEL}:latest", messages=ASK, options=options)
            parts = list(client.chat(model=MODEL, messages=ASK, options=options, stream=True))
            assert "".join(p.message.content for p in parts) == whole.message.content
            assert parts[-1].done and parts[-1].eval_count == whole.eval_count
            with pytest.raises(ollama.ResponseError) as raised:
                client.chat(model="qwen3:8b", messages=ASK)
            assert raised.value.status_code == 404
            assert [m.model for m in client.ps().models] == [f"{MODEL}:latest"]
            assert client.generate(model=MODEL, keep_alive=0).done_reason == "unload"
            deadline = time.monotonic() + 60  # the worker drains once the response has ended
            while workers(base_url) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert workers(base_url) == []
            assert client.ps().models == []
            loaded_before = load_seconds(base_url)
            again = client.chat(model=MODEL, messages=ASK, options=options)  # a worker loads it
            loaded = load_seconds(base_url) - loaded_before
            assert loaded > 0 and again.load_duration is not None
            assert again.load_duration >= loaded * 1e9  # the front's wait, counted by the worker
            assert again.total_duration is not None and again.total_duration >= again.load_duration
    finally:
        process.terminate()
        process.wait(timeout=60)
