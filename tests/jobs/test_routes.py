"""The job routes' wire: listing, 404s, validation 400s and the SSE stream's framing."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
from job_helpers import stream_events, submit, wait_for
from live_server import LiveServer

from modelhost.jobs.sse import job_frames
from modelhost.jobs.store import JobStore


def test_jobs_are_listed_newest_first_and_filtered_by_kind(server: LiveServer) -> None:
    with httpx.Client(base_url=server.base_url) as client:
        first = wait_for(client, submit(client, "steps"))["id"]
        second = wait_for(client, submit(client, "boom"))["id"]
        third = wait_for(client, submit(client, "steps"))["id"]
        everything = client.get("/api/jobs").json()
        steps = client.get("/api/jobs", params={"kind": "steps"}).json()
        one = client.get("/api/jobs", params={"limit": 1}).json()
    assert everything["ok"] is True
    assert [job["id"] for job in everything["jobs"]] == [third, second, first]
    assert [job["id"] for job in steps["jobs"]] == [third, first]
    assert [job["id"] for job in one["jobs"]] == [third]


def test_a_submitted_job_comes_back_with_its_row(server: LiveServer) -> None:
    with httpx.Client(base_url=server.base_url) as client:
        response = client.post("/api/jobs", json={"kind": "steps", "config": {"steps": 1}})
    body = response.json()
    assert response.status_code == 200
    assert body["ok"] is True
    assert body["job"]["id"].startswith("job_") and len(body["job"]["id"]) == 20
    assert body["job"]["kind"] == "steps"
    assert body["job"]["config"] == {"steps": 1}
    assert body["job"]["status"] == "queued"


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/api/jobs/job_0000000000000000"),
        ("GET", "/api/jobs/job_0000000000000000/stream"),
        ("POST", "/api/jobs/job_0000000000000000/cancel"),
    ],
)
def test_an_unknown_job_is_404_job_not_found(server: LiveServer, method: str, path: str) -> None:
    with httpx.Client(base_url=server.base_url) as client:
        response = client.request(method, path)
    assert response.status_code == 404
    assert response.json() == {"ok": False, "error": "job not found"}


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"kind": "nope"}, 'unknown job kind "nope"'),
        ({"config": {}}, "kind must be a non-empty string"),
        ({"kind": "bench-serve", "config": []}, "config must be an object"),
        ({"kind": "bench-serve", "config": {"concurrency": [0]}}, "concurrency entries must be"),
        ({"kind": "bench-serve", "config": {"max_tokens": "8"}}, "max_tokens must be an integer"),
        ({"kind": "bench-serve", "config": {"warp": 9}}, "unknown config field 'warp'"),
        ({"kind": "bench-serve", "config": {"url": "ftp://x"}}, "url must be an http(s) URL"),
        ({"kind": "eval-serve", "config": {"text": "   "}}, "text must contain words"),
        ({"kind": "convert", "config": {}}, "model must be a non-empty string"),
        ({"kind": "convert", "config": {"model": "no-such-model"}}, "model 'no-such-model'"),
        (
            {"kind": "convert", "config": {"model": "smollm2-135m-instruct", "dtype": "fp8"}},
            'dtype must be "bf16" or "fp32"',
        ),
    ],
)
def test_an_invalid_submission_is_400_with_the_reason(
    server: LiveServer, body: dict, reason: str
) -> None:
    with httpx.Client(base_url=server.base_url) as client:
        response = client.post("/api/jobs", json=body)
        listed = client.get("/api/jobs").json()["jobs"]
    assert response.status_code == 400
    assert response.json()["ok"] is False
    assert reason in response.json()["error"]
    assert listed == []  # nothing was recorded


def test_a_body_that_is_not_json_is_400(server: LiveServer) -> None:
    with httpx.Client(base_url=server.base_url) as client:
        response = client.post("/api/jobs", content=b"{nope")
    assert response.status_code == 400
    assert response.json() == {"ok": False, "error": "invalid JSON body"}


def test_the_stream_is_framed_as_server_sent_events(server: LiveServer) -> None:
    with httpx.Client(base_url=server.base_url) as client:
        job_id = wait_for(client, submit(client, "steps", {"steps": 1}))["id"]
        response = client.get(f"/api/jobs/{job_id}/stream")
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["cache-control"] == "no-cache"
    frames = response.text.split("\n\n")
    assert frames[0] == "retry: 1500"
    assert all(frame.startswith("data: ") for frame in frames[1:-2])
    assert frames[-2] == "event: end\ndata: {}"
    assert frames[-1] == ""


def test_a_late_subscriber_replays_the_whole_history(server: LiveServer) -> None:
    with httpx.Client(base_url=server.base_url) as client:
        job_id = wait_for(client, submit(client, "steps", {"steps": 2}))["id"]
        _, events = stream_events(client, job_id)
    assert [event["type"] for event in events] == ["started", "stage", "stage", "done"]
    assert [event.get("message") for event in events[1:3]] == ["step 1", "step 2"]
    assert events[-1]["summary"] == "2 steps"


def test_a_live_subscriber_sees_events_before_the_job_ends(
    server: LiveServer, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    seen: list[str] = []
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        job_id = submit(client, "gate", {"gate": str(gate)})
        with client.stream("GET", f"/api/jobs/{job_id}/stream") as response:
            for line in response.iter_lines():
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[5:])
                seen.append(event.get("type", "end"))
                if event.get("stage") == "waiting":
                    assert client.get(f"/api/jobs/{job_id}").json()["job"]["status"] == "running"
                    gate.touch()
    assert seen == ["started", "stage", "done", "end"]


def test_a_client_that_leaves_the_stream_early_does_not_disturb_the_job(
    server: LiveServer, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        job_id = submit(client, "gate", {"gate": str(gate)})
        with client.stream("GET", f"/api/jobs/{job_id}/stream") as response:
            for line in response.iter_lines():
                if line.startswith("data:"):
                    break  # leave after the first event
        time.sleep(0.3)
        gate.touch()
        job = wait_for(client, job_id)
        _, events = stream_events(client, job_id)
    assert job["status"] == "done"
    assert events[-1]["type"] == "done"


def test_a_zombie_streams_a_synthesised_failure(server: LiveServer) -> None:
    store = JobStore()
    orphan = store.create("steps", {})["id"]
    store.update(orphan, status="running")
    store.close()
    # A new store opening is what a restart does: it marks the orphan.
    reopened = JobStore()
    reopened.mark_zombies()
    reopened.close()
    with httpx.Client(base_url=server.base_url) as client:
        _, events = stream_events(client, orphan)
    assert events == [
        {
            "type": "failed",
            "error": "job interrupted by a previous process exit",
            "ts": events[0]["ts"],
        }
    ]


async def test_a_terminal_event_is_synthesised_from_the_row_when_none_was_logged() -> None:
    store = JobStore()
    job_id = store.create("convert", {})["id"]
    store.append_event(job_id, {"type": "started", "ts": "2026-01-01 00:00:00"})
    store.update(job_id, status="done", ended_at="2026-01-01 00:00:09", output_path="/out")

    async def never(timeout_s: float) -> None:
        raise AssertionError("a terminal row needs no waiting")

    frames = [frame async for frame in job_frames(store, job_id, never)]
    store.close()
    assert frames == [
        "retry: 1500\n\n",
        'data: {"type":"started","ts":"2026-01-01 00:00:00"}\n\n',
        'data: {"type":"done","ts":"2026-01-01 00:00:09","output_dir":"/out"}\n\n',
        "event: end\ndata: {}\n\n",
    ]


async def test_a_second_logged_terminal_event_is_not_sent() -> None:
    store = JobStore()
    job_id = store.create("convert", {})["id"]
    store.append_event(job_id, {"type": "failed", "error": "first", "ts": "t"})
    store.append_event(job_id, {"type": "done", "ts": "t"})
    store.update(job_id, status="failed", error="first", ended_at="t")

    async def never(timeout_s: float) -> None:
        raise AssertionError("a terminal row needs no waiting")

    frames = [frame async for frame in job_frames(store, job_id, never)]
    store.close()
    assert frames[1:] == [
        'data: {"type":"failed","error":"first","ts":"t"}\n\n',
        "event: end\ndata: {}\n\n",
    ]
