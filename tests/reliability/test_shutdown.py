"""`modelhost serve --in-process` as its own process: SIGTERM lets the stream in flight finish,
closes the port and exits 0. (A stream still running at 80% of `--shutdown-timeout` ends with
the `closed` error frame instead: tests/server/test_serve_process.py.)"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tiny_models import make_tiny_checkpoint

pytestmark = pytest.mark.slow  # the tiny model borrows SmolLM2's tokenizer

SERVE = """
import argparse, sys
from modelhost.cli.serve import run_serve
from modelhost.cli.serve_args import add_serve_parser
parser = argparse.ArgumentParser(prog="modelhost")
add_serve_parser(parser.add_subparsers(dest="command"))
sys.exit(run_serve(parser.parse_args(["serve", *sys.argv[1:]])))
"""
SHUTDOWN_TIMEOUT_S = 10.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def tiny_model(smollm2: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("models") / "tiny-llama", "llama", smollm2)


@pytest.fixture
def serving(tiny_model: Path, tmp_path: Path) -> Iterator[dict[str, Any]]:
    port = free_port()
    log_path = tmp_path / "serve.log"
    argv = [str(tiny_model), "--in-process", "--port", str(port), "--batch", "2",
            "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]  # fmt: skip
    with log_path.open("wb") as log:
        process = subprocess.Popen([sys.executable, "-c", SERVE, *argv], stdout=log, stderr=log)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, log_path.read_text()
            try:
                if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "serve did not become healthy"
            time.sleep(0.2)
        yield {"process": process, "url": base_url, "log": log_path}
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_sigterm_lets_the_stream_in_flight_finish_closes_the_port_and_exits_0(
    serving: dict[str, Any],
) -> None:
    process: subprocess.Popen[bytes] = serving["process"]
    body = {
        "messages": [{"role": "user", "content": "Count."}],
        "max_tokens": 24,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    first_token = threading.Event()
    lines: list[str] = []

    def read_stream() -> None:
        url = f"{serving['url']}/v1/chat/completions"
        with httpx.Client(timeout=60) as client, client.stream("POST", url, json=body) as answer:
            for line in answer.iter_lines():
                if '"content"' in line:
                    first_token.set()
                if line:
                    lines.append(line)

    reader = threading.Thread(target=read_stream, daemon=True)
    reader.start()
    assert first_token.wait(timeout=60)
    process.send_signal(signal.SIGTERM)
    stopped_at = time.monotonic()
    assert process.wait(timeout=SHUTDOWN_TIMEOUT_S + 30) == 0
    assert time.monotonic() - stopped_at < SHUTDOWN_TIMEOUT_S + 20
    reader.join(timeout=10)
    assert lines[-1] == "data: [DONE]"
    usage = json.loads(lines[-2].removeprefix("data: "))["usage"]
    assert usage["completion_tokens"] == 24  # the whole answer, not a cut one
    log_text = serving["log"].read_text()
    assert "POST /v1/chat/completions 200" in log_text
    assert "500 on" not in log_text
    with pytest.raises(httpx.TransportError):  # the port is closed
        httpx.get(f"{serving['url']}/health", timeout=2)
