"""`modelhost serve` (worker processes, the default) with its prefix KV store on disk: a long
prompt the server has seen is served from the store after its model was unloaded and loaded
again, and after the server itself restarted, with the same greedy answer as its cold prefill;
`DELETE /api/kv` and `modelhost cache clear --kv` empty the store."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from live_server import free_port
from test_serve_process import SERVE, wait_for_health

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

MODEL = "smollm2-135m-instruct"


class Server:
    """`modelhost serve` in its own process group on a free port, over `home`."""

    def __init__(self, home: Path, log: Path) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        argv = ["--port", str(self.port), "--batch", "2", "--kv-disk", "1", "--hold", "0"]
        env = {**os.environ, "MODELHOST_HOME": str(home)}
        with log.open("ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-c", SERVE, *argv],
                stdout=out,
                stderr=out,
                env=env,
                start_new_session=True,
            )
        try:
            wait_for_health(self.base_url, self.process)
        except BaseException:
            self.stop()
            raise
        self.client = openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="x", max_retries=0)

    def ask(self, prompt: str) -> tuple[str, int, int]:
        """The greedy answer, its prompt tokens and the prompt tokens served from a cache."""
        reply = self.client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=16,
            temperature=0,
            timeout=600,
        )
        usage = reply.usage
        assert usage is not None and usage.prompt_tokens_details is not None
        cached = usage.prompt_tokens_details.cached_tokens or 0
        return reply.choices[0].message.content or "", usage.prompt_tokens, cached

    def unload(self) -> None:
        response = httpx.post(f"{self.base_url}/api/models/{MODEL}/unload", timeout=60)
        assert response.status_code == 200, response.text

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def long_prompt() -> str:
    """~1,200 tokens no earlier run has sent (a fresh id first: its cold prefill is cold)."""
    facts = " ".join(f"Box {i} holds {i * 7 % 13} marbles." for i in range(110))
    return f"Session {uuid.uuid4().hex}. {facts} How many marbles does box 3 hold?"


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    """A home of its own, with the suite's converted-model cache linked in."""
    home = tmp_path / "home"
    home.mkdir()
    suite_cache = Path(os.environ["MODELHOST_HOME"]) / "cache"
    if suite_cache.exists():
        (home / "cache").symlink_to(suite_cache)
    yield home


def test_an_unloaded_model_serves_a_seen_long_prompt_from_the_store_with_the_same_answer(
    home: Path, tmp_path: Path
) -> None:
    server = Server(home, tmp_path / "serve.log")
    try:
        prompt = long_prompt()
        cold, num_prompt, cached = server.ask(prompt)
        assert num_prompt > 1000 and cached == 0
        server.unload()
        warm, num_prompt_again, cached = server.ask(prompt)
        assert num_prompt_again == num_prompt
        assert cached >= 0.95 * num_prompt
        assert warm == cold

        stats = httpx.get(f"{server.base_url}/stats", timeout=10).json()["kv_store"]
        assert stats["bytes"] > 0 and [m["id"] for m in stats["models"]] == [MODEL]
        cleared = httpx.delete(f"{server.base_url}/api/kv", params={"model": MODEL}, timeout=30)
        assert cleared.status_code == 200, cleared.text
        assert cleared.json()["removed"]["bytes"] == stats["bytes"]
        assert cleared.json()["store"]["files"] == 0
        unknown = httpx.delete(f"{server.base_url}/api/kv", params={"model": "nope"}, timeout=30)
        assert unknown.status_code == 404
        assert unknown.json()["error"]["code"] == "model_not_found"
    finally:
        server.stop()


def test_a_restarted_server_serves_a_seen_long_prompt_from_the_store_with_the_same_answer(
    home: Path, tmp_path: Path
) -> None:
    prompt = long_prompt()
    first = Server(home, tmp_path / "serve.log")
    try:
        cold, num_prompt, _ = first.ask(prompt)
    finally:
        first.stop()
    second = Server(home, tmp_path / "serve.log")
    try:
        warm, _, cached = second.ask(prompt)
    finally:
        second.stop()
    assert cached >= 0.95 * num_prompt
    assert warm == cold

    env = {**os.environ, "MODELHOST_HOME": str(home)}
    command = [sys.executable, "-m", "modelhost", "cache"]
    listed = subprocess.run([*command, "ls"], env=env, capture_output=True, text=True, check=True)
    assert MODEL in listed.stdout
    clear = [*command, "clear", "--kv"]
    subprocess.run(clear, env=env, capture_output=True, text=True, check=True)
    listed = subprocess.run([*command, "ls"], env=env, capture_output=True, text=True, check=True)
    assert "KV store 0.00 GB (0 blocks)" in listed.stdout
