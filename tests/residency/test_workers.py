"""Worker processes end to end: tiny models served from their own processes behind one port."""

from __future__ import annotations

import json
import os
import signal
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from routed_world import LiveServer

from modelhost.residency.host import ResidencyHost
from modelhost.residency.registry import ModelRegistry, ServingShape
from modelhost.residency.router import ModelRouter
from modelhost.residency.worker_unit import PID_HEADER, WorkerUnit, worker_loader
from modelhost.server.app import ServeSettings, create_routed_app

pytestmark = pytest.mark.slow
SHAPE = ServingShape(batch=2)
WAIT_S = 60.0


@pytest.fixture
def served(models_dir, tmp_path) -> Iterator[dict[str, Any]]:
    registry = ModelRegistry(
        [models_dir], home=tmp_path / "home", hf_hub=tmp_path / "hub", embedded=False, shape=SHAPE
    )
    settings = ServeSettings()
    host: ResidencyHost[WorkerUnit] = ResidencyHost(
        budget_bytes=10**12,
        source=registry.get,
        load=worker_loader(settings, batch=2, start_timeout_s=WAIT_S),
        hold_s=0.0,
    )
    router = ModelRouter(host, registry, current="tiny-a")
    pids: list[int] = []
    world: dict[str, Any] = {"host": host, "pids": pids}
    with LiveServer(create_routed_app(router, settings)) as server:
        world["url"] = server.base_url
        with httpx.Client(base_url=server.base_url, timeout=WAIT_S) as client:
            world["client"] = client
            yield world
    assert host.resident() == []
    for pid in pids:
        assert not process_alive(pid), f"worker {pid} outlived the server"


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    try:
        return "State:\tZ" not in status.read_text()
    except OSError:
        return False


def wait_gone(pid: int) -> None:
    deadline = time.monotonic() + 15
    while process_alive(pid):
        assert time.monotonic() < deadline, f"process {pid} is still running"
        time.sleep(0.05)


def chat(client: httpx.Client, model: str, **extra: Any) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return client.post("/v1/chat/completions", json={**body, **extra})


def unit_of(world: dict[str, Any], model_id: str) -> WorkerUnit:
    unit = world["host"].peek(model_id)
    assert unit is not None
    world["pids"].append(unit.pid)
    return unit  # type: ignore[no-any-return]


def test_a_worker_process_answers_on_a_private_socket(served):
    client = served["client"]
    reply = chat(client, "tiny-a")
    assert reply.status_code == 200, reply.text
    assert reply.json()["model"] == "tiny-a"
    pid = int(reply.headers[PID_HEADER])
    assert pid != os.getpid()
    unit = unit_of(served, "tiny-a")
    assert unit.pid == pid
    socket_path = Path(unit.worker.socket_path)
    assert stat.S_ISSOCK(socket_path.stat().st_mode)
    assert stat.S_IMODE(socket_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(socket_path.parent.stat().st_mode) == 0o700
    stats = client.get("/stats").json()
    assert stats["worker"]["pid"] == pid
    resident = stats["models"]["resident"][0]
    assert resident["bytes"] >= unit.weights_bytes  # the RSS, never below the weights


def test_a_worker_killed_mid_stream_ends_with_one_error_frame_and_is_respawned(served):
    client = served["client"]
    assert chat(client, "tiny-a").status_code == 200
    unit = unit_of(served, "tiny-a")
    first_pid = unit.pid
    body = {
        "model": "tiny-a",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
    }
    frames: list[str] = []
    with client.stream("POST", "/v1/chat/completions", json=body) as stream:
        assert stream.status_code == 200
        killed = False
        for line in stream.iter_lines():
            if not line.startswith("data: "):
                continue
            frames.append(line)
            if not killed:
                os.kill(first_pid, signal.SIGKILL)
                killed = True
    errors = [f for f in frames if '"error"' in f]
    assert len(errors) == 1, frames[-3:]
    assert frames[-1] == errors[0]
    error = json.loads(errors[0][len("data: ") :])["error"]
    assert error["code"] == "engine_unavailable"
    reply = chat(client, "tiny-a")
    assert reply.status_code == 200, reply.text
    assert int(reply.headers[PID_HEADER]) != first_pid
    assert unit.worker.restarts == 1
    served["pids"].append(unit.pid)


def test_evicting_a_model_stops_its_worker_and_removes_its_socket(served):
    client = served["client"]
    assert chat(client, "tiny-b").status_code == 200
    unit = unit_of(served, "tiny-b")
    pid, directory = unit.pid, Path(unit.worker.socket_path).parent
    reply = client.post("/api/models/tiny-b/unload")
    assert reply.status_code == 200, reply.text
    wait_gone(pid)
    assert not directory.exists()
    assert served["host"].peek("tiny-b") is None
