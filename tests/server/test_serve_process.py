"""`run_serve` in its own process over SmolLM2 (in its worker process, the default): it serves,
and SIGINT/SIGTERM end it in time, leaving no worker process or socket behind."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from live_server import free_port

pytestmark = pytest.mark.slow

SERVE = """
import argparse, sys
from modelhost.cli.serve import run_serve
from modelhost.cli.serve_args import add_serve_parser
parser = argparse.ArgumentParser(prog="modelhost")
add_serve_parser(parser.add_subparsers(dest="command"))
sys.exit(run_serve(parser.parse_args(["serve", *sys.argv[1:]])))
"""
SHUTDOWN_TIMEOUT_S = 2.0


def wait_for_health(base_url: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"serve exited early with {process.returncode}")
        try:
            if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError("serve did not become healthy")


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT])
def test_serve_ends_an_endless_stream_and_exits_cleanly_within_the_shutdown_timeout(
    tmp_path: Path, stop_signal: signal.Signals
) -> None:
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "serve.log"
    argv = ["--port", str(port), "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S), "--batch", "2"]
    with log_path.open("wb") as log:
        process = subprocess.Popen([sys.executable, "-c", SERVE, *argv], stdout=log, stderr=log)
    try:
        wait_for_health(base_url, process)
        streaming = threading.Event()
        body = {
            "messages": [{"role": "user", "content": "Count to a million."}],
            "max_tokens": 4000,
            "ignore_eos": True,
            "stream": True,
        }

        last_lines: list[str] = []

        def stream_forever() -> None:
            with (
                httpx.Client(timeout=120) as client,
                client.stream("POST", f"{base_url}/v1/chat/completions", json=body) as response,
            ):
                for line in response.iter_lines():
                    if '"content"' in line:
                        streaming.set()
                    if line:
                        last_lines[:] = [line]

        reader = threading.Thread(target=stream_forever, daemon=True)
        reader.start()
        assert streaming.wait(timeout=120)
        [worker] = httpx.get(f"{base_url}/engine").json()["workers"]
        process.send_signal(stop_signal)
        started = time.monotonic()
        assert process.wait(timeout=60) == 0
        assert time.monotonic() - started < SHUTDOWN_TIMEOUT_S + 20
        reader.join(timeout=10)
        assert not reader.is_alive()
        assert json.loads(last_lines[0].removeprefix("data: "))["error"]["code"] == "closed"
        assert not Path(f"/proc/{worker['pid']}").exists()  # the model's worker was joined
        assert not Path(worker["socket"]).parent.exists()  # and its socket's directory removed
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    log_text = log_path.read_text()
    assert "POST /v1/chat/completions 503" in log_text
    assert "500 on" not in log_text


def mapped_libraries(pid: int) -> set[str]:
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {Path(line.split()[-1]).name for line in maps if line.split()[-1].endswith(".so")}


def test_the_front_process_answers_without_loading_pytorch_which_lives_in_the_models_worker(
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
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(
            model="smollm2-135m-instruct",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
        )
        assert reply.choices[0].message.content
        assert httpx.get(f"{base_url}/v1/models").status_code == 200
        assert httpx.get(f"{base_url}/stats").status_code == 200
        [worker] = httpx.get(f"{base_url}/engine").json()["workers"]
        assert "libtorch_cpu.so" in mapped_libraries(worker["pid"])
        assert "libtorch_cpu.so" not in mapped_libraries(process.pid)
    finally:
        process.terminate()
        process.wait(timeout=60)
