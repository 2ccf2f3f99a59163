"""The job host over HTTP: submit, progress, done, failure, cancel, queueing and shutdown."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
from job_helpers import alive, scripted_app, submit, wait_for, wait_for_event
from live_server import LiveServer
from scripted_engine import ScriptedEngine

from modelhost.jobs.store import JobStore


def test_a_job_reports_its_progress_and_ends_done(server: LiveServer) -> None:
    with httpx.Client(base_url=server.base_url) as client:
        job_id = submit(client, "steps", {"steps": 3})
        job = wait_for(client, job_id)
    assert job["status"] == "done"
    assert job["progress"] == 1.0
    assert job["message"] == "step 3"
    assert job["error"] is None
    assert job["ended_at"] is not None


def test_a_jobs_events_are_logged_as_ndjson_under_modelhost_home(
    server: LiveServer, home: Path
) -> None:
    with httpx.Client(base_url=server.base_url) as client:
        job_id = wait_for(client, submit(client, "steps", {"steps": 2}))["id"]
    lines = (home / "jobs" / f"{job_id}.log").read_text().splitlines()
    types = [json.loads(line)["type"] for line in lines]
    assert types == ["started", "stage", "stage", "done"]
    assert json.loads(lines[-1])["summary"] == "2 steps"
    assert (home / "db" / "jobs.sqlite").is_file()


def test_a_job_that_raises_fails_with_the_error_named(server: LiveServer) -> None:
    with httpx.Client(base_url=server.base_url) as client:
        job = wait_for(client, submit(client, "boom"))
    assert job["status"] == "failed"
    assert job["error"] == "ValueError: bad input"


def test_a_child_process_job_reports_events_and_its_result(server: LiveServer) -> None:
    with httpx.Client(base_url=server.base_url) as client:
        job = wait_for(client, submit(client, "child-steps"))
    assert job["status"] == "done"
    assert job["output_path"] == "/tmp/out"
    assert job["progress"] == 1.0


def test_a_child_that_dies_without_a_result_fails_with_its_exit_status(
    server: LiveServer,
) -> None:
    with httpx.Client(base_url=server.base_url) as client:
        job = wait_for(client, submit(client, "crash"))
    assert job["status"] == "failed"
    assert job["error"] == "exited 3: dying"


def test_cancelling_a_child_job_kills_its_whole_process_group(server: LiveServer) -> None:
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        job_id = submit(client, "sleeper")
        pids = wait_for_event(client, job_id, "sleeping")
        assert alive(pids["pid"]) and alive(pids["grandchild"])
        response = client.post(f"/api/jobs/{job_id}/cancel")
    assert response.status_code == 200
    assert response.json()["job"]["status"] == "failed"
    assert response.json()["job"]["error"] == "job cancelled"
    assert not alive(pids["pid"])
    deadline = time.monotonic() + 5  # the grandchild is reparented, then reaped by init
    while alive(pids["grandchild"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pids["grandchild"])


def test_cancelling_a_finished_job_is_a_conflict(server: LiveServer) -> None:
    with httpx.Client(base_url=server.base_url) as client:
        job_id = wait_for(client, submit(client, "steps"))["id"]
        response = client.post(f"/api/jobs/{job_id}/cancel")
    assert response.status_code == 409
    assert response.json()["ok"] is False
    assert response.json()["job"]["status"] == "done"


def test_jobs_that_drive_the_model_wait_queued_for_each_other(
    server: LiveServer, tmp_path: Path
) -> None:
    first_gate, second_gate = tmp_path / "first", tmp_path / "second"
    with httpx.Client(base_url=server.base_url) as client:
        first = submit(client, "exclusive-gate", {"gate": str(first_gate)})
        wait_for(client, first, ("running",))
        second = submit(client, "exclusive-gate", {"gate": str(second_gate)})
        time.sleep(0.3)
        assert client.get(f"/api/jobs/{second}").json()["job"]["status"] == "queued"
        first_gate.touch()
        second_gate.touch()
        assert wait_for(client, first)["status"] == "done"
        assert wait_for(client, second)["status"] == "done"


def test_a_queued_job_can_be_cancelled_before_it_starts(server: LiveServer, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    with httpx.Client(base_url=server.base_url) as client:
        first = submit(client, "exclusive-gate", {"gate": str(gate)})
        wait_for(client, first, ("running",))
        second = submit(client, "exclusive-gate", {"gate": str(gate)})
        cancelled = client.post(f"/api/jobs/{second}/cancel").json()["job"]
        gate.touch()
        wait_for(client, first)
    assert cancelled["status"] == "failed"
    assert cancelled["error"] == "job cancelled"


def test_shutting_the_server_down_fails_running_jobs_and_kills_their_children(
    live_app, home: Path
) -> None:
    server = live_app()
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        job_id = submit(client, "sleeper")
        pids = wait_for_event(client, job_id, "sleeping")
    server.stop()
    assert not alive(pids["pid"])
    store = JobStore()
    job = store.get(job_id)
    store.close()
    assert job is not None
    assert (job["status"], job["error"]) == ("failed", "job host closed")


def test_a_job_driving_the_servers_own_api_does_not_hold_up_its_shutdown(live_app) -> None:
    slow = ScriptedEngine(["token"] * 100, step_s=0.1)  # each request streams for 10 s
    server = live_app(scripted_app(slow))
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        job_id = submit(client, "self-load")
        wait_for_event(client, job_id, "requesting")
    started = time.monotonic()
    server.stop()
    assert time.monotonic() - started < 2.5  # not the 4 s the drain would wait
    store = JobStore()
    job = store.get(job_id)
    store.close()
    assert job is not None and job["error"] == "job host closed"


def test_jobs_left_running_by_a_previous_process_become_zombies(live_app, home: Path) -> None:
    store = JobStore()
    orphan = store.create("steps", {})["id"]
    store.update(orphan, status="running")
    store.close()
    server = live_app()
    with httpx.Client(base_url=server.base_url) as client:
        job = client.get(f"/api/jobs/{orphan}").json()["job"]
    assert job["status"] == "zombie"
    assert job["error"] == "job interrupted by a previous process exit"
