"""Helpers shared by the job tests: a scripted server app with the test job kinds, and a client's
submit-and-wait."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
from job_test_kinds import TEST_KINDS
from scripted_engine import ScriptedEngine, scripted_model
from starlette.applications import Starlette

from modelhost.assembly import build_app
from modelhost.server.settings import ServeSettings

TERMINAL = ("done", "failed", "zombie")


def submit(client: httpx.Client, kind: str, config: dict[str, Any] | None = None) -> str:
    response = client.post("/api/jobs", json={"kind": kind, "config": config or {}})
    assert response.status_code == 200, response.text
    return str(response.json()["job"]["id"])


def wait_for(
    client: httpx.Client, job_id: str, statuses: tuple[str, ...] = TERMINAL, timeout_s: float = 60
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        job = client.get(f"/api/jobs/{job_id}").json()["job"]
        if job["status"] in statuses:
            return job  # type: ignore[no-any-return]
        assert time.monotonic() < deadline, f"job stayed {job['status']}: {job}"
        time.sleep(0.05)


def stream_events(client: httpx.Client, job_id: str) -> tuple[str, list[dict[str, Any]]]:
    """The raw SSE body of a job's stream and its data events (the final `{}` excluded)."""
    response = client.get(f"/api/jobs/{job_id}/stream")
    assert response.status_code == 200
    body = response.text
    events = [json.loads(line[5:]) for line in body.splitlines() if line.startswith("data:")]
    return body, [event for event in events if event]


def wait_for_event(
    client: httpx.Client, job_id: str, stage: str, timeout_s: float = 60
) -> dict[str, Any]:
    """The first logged `stage` event with this stage name, read from the job's log route."""
    deadline = time.monotonic() + timeout_s
    with client.stream("GET", f"/api/jobs/{job_id}/stream") as response:
        for line in response.iter_lines():
            assert time.monotonic() < deadline
            if line.startswith("data:"):
                event = json.loads(line[5:])
                if event.get("stage") == stage:
                    return event  # type: ignore[no-any-return]
    raise AssertionError(f"no {stage} event")


def alive(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie waiting to be reaped does not count)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def scripted_app(engine: ScriptedEngine | None = None) -> Starlette:
    app = build_app(engine or ScriptedEngine(), scripted_model(), ServeSettings())
    app.state.jobs.kinds.update(TEST_KINDS)
    return app
