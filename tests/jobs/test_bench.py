"""`modelhost bench` and the `bench-serve` job, against a live server over a scripted engine
(the load generator is the point, not the model)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from job_helpers import scripted_app, submit, wait_for
from live_server import LiveServer, free_port
from scripted_engine import ScriptedEngine

from modelhost.bench import BenchConfig, percentile, run_bench
from modelhost.cli.main import main

SCRIPT = ("one", " two", " three", " four", " five", " six")


@pytest.fixture
def engine() -> ScriptedEngine:
    return ScriptedEngine(SCRIPT, step_s=0.003)


@pytest.fixture
def bench_server(live_app, engine: ScriptedEngine) -> LiveServer:
    return live_app(scripted_app(engine))


async def test_bench_times_every_concurrency_level(bench_server: LiveServer) -> None:
    config = BenchConfig(bench_server.base_url, (1, 3), prompt_tokens=40, max_tokens=5)
    report = await run_bench(config)
    assert [level.concurrency for level in report.levels] == [1, 3]
    for level in report.levels:
        assert level.ok == level.requests == level.concurrency
        assert level.completion_tokens == 5 * level.requests
        assert level.ttft_ms_p50 is not None and level.ttft_ms_p95 is not None
        assert level.itl_ms_p50 is not None and level.itl_ms_p50 > 0
        assert level.stream_tps is not None and level.aggregate_tps > 0
        assert level.errors == []


async def test_bench_asks_for_max_tokens_and_ignore_eos_with_a_fresh_prompt_each_time(
    bench_server: LiveServer, engine: ScriptedEngine
) -> None:
    config = BenchConfig(bench_server.base_url, (2,), prompt_tokens=60, max_tokens=3, requests=4)
    await run_bench(config)
    measured = engine.submissions[2:]  # after the two warm-ups that size the prompt
    assert len(measured) == 4
    assert all(s.params.ignore_eos and s.params.max_tokens == 3 for s in measured)
    assert len({tuple(s.prompt_ids) for s in measured}) == 4
    # ~60 tokens as the server counts them (a character per token here)
    assert all(abs(len(s.prompt_ids) - 60) <= 15 for s in measured)


def test_percentiles_interpolate_between_ranks() -> None:
    assert percentile([], 50) is None
    assert percentile([4.0], 95) == 4.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert percentile([0.0, 10.0], 95) == pytest.approx(9.5)


def test_modelhost_bench_prints_a_table_and_writes_json(
    bench_server: LiveServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.json"
    argv = ["bench", "--url", bench_server.base_url, "--concurrency", "1,2"]
    argv += ["--prompt-tokens", "20", "--max-tokens", "4", "--ignore-eos", "--json", str(out)]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "ttft p50" in table and "tok/s total" in table
    assert len(table.strip().splitlines()) == 4  # title, header, two levels
    results = json.loads(out.read_text())
    assert [level["concurrency"] for level in results["levels"]] == [1, 2]
    assert results["config"]["ignore_eos"] is True
    assert "api_key" not in results["config"]


def test_modelhost_bench_says_so_when_the_server_cannot_be_reached(
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["bench", "--url", url, "--concurrency", "1", "--max-tokens", "2"]) == 1
    assert "warm-up request failed" in capsys.readouterr().err


def test_a_bench_serve_job_reports_each_level_and_ends_with_the_table(
    bench_server: LiveServer,
) -> None:
    config = {"concurrency": [1, 2], "prompt_tokens": 16, "max_tokens": 4, "requests": 2}
    with httpx.Client(base_url=bench_server.base_url, timeout=30) as client:
        job = wait_for(client, submit(client, "bench-serve", config))
        events = [
            json.loads(line[5:])
            for line in client.get(f"/api/jobs/{job['id']}/stream").text.splitlines()
            if line.startswith("data:")
        ]
    assert job["status"] == "done", job["error"]
    levels = [event for event in events if event.get("kind") == "bench"]
    assert [(e["concurrency"], e["ok"]) for e in levels] == [(1, 2), (2, 2)]
    assert [e["progress"] for e in levels] == [0.5, 1.0]
    done = events[-2]
    assert done["type"] == "done"
    assert "tok/s total" in done["summary"]
    assert [lv["completion_tokens"] for lv in done["results"]["levels"]] == [8, 8]
