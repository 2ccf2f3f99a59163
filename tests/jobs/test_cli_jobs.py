"""`modelhost jobs`: a running server's jobs from the terminal."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from job_helpers import submit, wait_for
from live_server import LiveServer

from modelhost.cli.main import main


def test_jobs_ls_shows_a_progress_bar_for_a_running_job(
    server: LiveServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gate = tmp_path / "gate"
    with httpx.Client(base_url=server.base_url) as client:
        finished = wait_for(client, submit(client, "steps"))["id"]
        running = submit(client, "gate", {"gate": str(gate)})
        wait_for(client, running, ("running",))
        assert main(["jobs", "--url", server.base_url, "ls"]) == 0
        gate.touch()
        wait_for(client, running)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(running)
    assert "running" in lines[0] and "[##########----------]  50%" in lines[0]
    assert lines[1].startswith(finished) and "done" in lines[1]


def test_jobs_follow_prints_each_event_and_exits_0_when_the_job_is_done(
    server: LiveServer, capsys: pytest.CaptureFixture[str]
) -> None:
    with httpx.Client(base_url=server.base_url) as client:
        job_id = submit(client, "steps", {"steps": 2})
    assert main(["jobs", "--url", server.base_url, "follow", job_id]) == 0
    out = capsys.readouterr().out
    assert "step 1" in out and "step 2" in out
    assert out.rstrip().endswith("2 steps")


def test_jobs_follow_exits_1_when_the_job_failed(
    server: LiveServer, capsys: pytest.CaptureFixture[str]
) -> None:
    with httpx.Client(base_url=server.base_url) as client:
        job_id = submit(client, "boom")
    assert main(["jobs", "--url", server.base_url, "follow", job_id]) == 1
    assert "failed: ValueError: bad input" in capsys.readouterr().out


def test_jobs_cancel_stops_a_running_job(
    server: LiveServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with httpx.Client(base_url=server.base_url) as client:
        job_id = submit(client, "gate", {"gate": str(tmp_path / "never")})
        wait_for(client, job_id, ("running",))
        assert main(["jobs", "--url", server.base_url, "cancel", job_id]) == 0
        assert client.get(f"/api/jobs/{job_id}").json()["job"]["error"] == "job cancelled"
    assert "job cancelled" in capsys.readouterr().out


def test_jobs_show_prints_the_row_or_says_the_job_is_not_found(
    server: LiveServer, capsys: pytest.CaptureFixture[str]
) -> None:
    with httpx.Client(base_url=server.base_url) as client:
        job_id = wait_for(client, submit(client, "steps"))["id"]
    assert main(["jobs", "--url", server.base_url, "show", job_id]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "done"
    assert main(["jobs", "--url", server.base_url, "show", "job_0000000000000000"]) == 1
    assert "job not found" in capsys.readouterr().err


def test_jobs_submit_starts_a_job_and_can_follow_it(
    server: LiveServer, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["jobs", "--url", server.base_url, "submit", "steps", '{"steps": 1}', "--follow"]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("job_")
    assert out[-1] == "1 steps"
