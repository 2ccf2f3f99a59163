"""A warm spare worker and the fork server under a real server: a spare becomes the next model's
worker and a new spare replaces it; a killed spare is never handed a model; answers are the same
either way, and from a forked worker as from a spawned one; `serve` stops its spare, its fork
server and their workers on SIGINT and SIGTERM, and they end when it is killed; it keeps no spare
in-process or with --no-spare-worker, and no fork server with --no-fork-server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from live_server import LiveServer, free_port

from modelhost.assembly import worker_loader
from modelhost.residency.host import ResidencyHost
from modelhost.residency.registry import ModelRegistry, ServingShape
from modelhost.residency.router import ModelRouter
from modelhost.residency.workers.spare_pool import SpareWorkers
from modelhost.residency.workers.worker_unit import WorkerUnit
from modelhost.serve_config import WORKER_MODULE
from modelhost.server.app import create_routed_app
from modelhost.server.observability.prometheus import WorkerSamples
from modelhost.server.settings import ServeSettings

pytestmark = pytest.mark.slow
WAIT_S = 300.0  # a spare warms up at a low priority: slow on a busy machine
SERVE = """
import argparse, sys
from modelhost.cli.serve import run_serve
from modelhost.cli.serve_args import add_serve_parser
parser = argparse.ArgumentParser(prog="modelhost")
add_serve_parser(parser.add_subparsers(dest="command"))
sys.exit(run_serve(parser.parse_args(["serve", *sys.argv[1:]])))
"""


def process_alive(pid: int) -> bool:
    """Running (a zombie is not)."""
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def until(condition: Callable[[], Any], timeout_s: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)
    return value


@pytest.fixture
def served(models_dir, tmp_path, request) -> Iterator[dict[str, Any]]:
    registry = ModelRegistry(
        [models_dir], home=tmp_path / "home", hf_hub=tmp_path / "hub", embedded=False,
        shape=ServingShape(batch=2),
    )  # fmt: skip
    settings = ServeSettings()
    samples = WorkerSamples()
    options = getattr(request, "param", {})  # the pool's
    spares = SpareWorkers(WORKER_MODULE, env=samples.env(), **options)  # as `serve` wires it
    load = worker_loader(
        settings, batch=2, start_timeout_s=WAIT_S, env=samples.env(), spares=spares
    )
    host: ResidencyHost[WorkerUnit] = ResidencyHost(
        budget_bytes=10**12, source=registry.get, load=load, external=spares.held_bytes
    )
    spares.follow(host)
    router = ModelRouter(host, registry, current="tiny-a")
    app = create_routed_app(router, settings, worker_samples=samples, spare_workers=spares)
    pids: list[int] = []
    with (
        LiveServer(app) as server,
        httpx.Client(base_url=server.base_url, timeout=WAIT_S) as client,
    ):
        yield {"client": client, "pids": pids}
        pids += [p for p in (engine(client)["spare"]["pid"],) if p is not None]
        pids += [row["pid"] for row in engine(client)["workers"]]
    for pid in pids:
        assert not process_alive(pid), f"process {pid} outlived the server"


def engine(client: httpx.Client) -> dict[str, Any]:
    view = client.get("/engine")
    assert view.status_code == 200
    return view.json()  # type: ignore[no-any-return]


def worker_row(client: httpx.Client, model_id: str) -> dict[str, Any]:
    return next(row for row in engine(client)["workers"] if row["id"] == model_id)


def ready_spare(client: httpx.Client) -> int:
    spare = until(lambda: (s := engine(client)["spare"])["state"] == "ready" and s)
    assert spare["rss_bytes"] > 0
    return int(spare["pid"])


def complete(client: httpx.Client, model: str) -> str:
    body = {"model": model, "prompt": "The spare", "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    reply = client.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    return str(reply.json()["choices"][0]["text"])


def test_a_load_takes_the_warm_spare_and_a_new_spare_replaces_it(served):
    client = served["client"]
    spare_pid = ready_spare(client)
    complete(client, "tiny-a")
    row = worker_row(client, "tiny-a")
    assert row["pid"] == spare_pid and row["from_spare"] is True
    assert row["startup"]["weights_ms"] >= 0 and "spare_wait_ms" in row["startup"]
    next_pid = until(lambda: engine(client)["spare"]["pid"])
    assert next_pid != spare_pid
    served["pids"] += [spare_pid, next_pid]


# Not waiting for a spare still warming up: the load after the kill starts a new process.
@pytest.mark.parametrize("served", [{"wait_s": 0.0}], indirect=True)
def test_a_killed_spare_is_not_used_and_is_replaced_and_answers_do_not_change(served):
    client = served["client"]
    killed = ready_spare(client)
    subprocess.run(["kill", "-9", str(killed)], check=True)
    until(lambda: not process_alive(killed))
    cold = complete(client, "tiny-a")
    row = worker_row(client, "tiny-a")
    assert row["pid"] != killed and row["from_spare"] is False
    replacement = ready_spare(client)
    assert replacement != killed and engine(client)["spare"]["died"] == 1
    assert client.post("/api/models/tiny-a/unload").status_code == 200
    assert complete(client, "tiny-a") == cold  # the same greedy tokens from a spare
    assert worker_row(client, "tiny-a")["pid"] == replacement
    served["pids"] += [killed, row["pid"], replacement]


def start_serve(
    model: Path, *flags: str, log: Path | None = None
) -> tuple[subprocess.Popen[bytes], httpx.Client]:
    """`serve` on a free port, its log written to `log` (read by a failing assertion)."""
    port = free_port()
    argv = [str(model), "--port", str(port), "--batch", "1", *flags]
    with open(log or os.devnull, "wb") as stderr:
        process = subprocess.Popen([sys.executable, "-c", SERVE, *argv], stderr=stderr)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=WAIT_S)

    def healthy() -> bool:
        assert process.poll() is None, "serve exited"
        try:
            return client.get("/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    until(healthy)
    return process, client


def serving_pids(client: httpx.Client, log: Path) -> list[int]:
    """The spare's, the fork server's and the workers' pids, once a forked spare is ready."""
    until(lambda: engine(client)["spare"]["state"] == "ready")
    view = engine(client)
    forked = view["spare"]["forked"] and view["fork_server"]["state"] == "ready"
    assert forked and all(row["forked"] for row in view["workers"]), log.read_text()
    return [view["spare"]["pid"], view["fork_server"]["pid"], *(w["pid"] for w in view["workers"])]


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_serve_leaves_no_spare_worker_fork_server_or_forked_worker_behind(
    models_dir, tmp_path, stop
):
    process, client = start_serve(models_dir / "tiny-a", log=tmp_path / "serve.log")
    try:
        pids = serving_pids(client, tmp_path / "serve.log")
        process.send_signal(stop)
        assert process.wait(timeout=60) == 0
        for pid in pids:
            until(lambda pid=pid: not process_alive(pid), timeout_s=15)
    finally:
        client.close()
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_killed_serve_leaves_no_fork_server_spare_or_forked_worker_or_their_folders(
    models_dir, tmp_path
):
    process, client = start_serve(models_dir / "tiny-a", log=tmp_path / "serve.log")
    try:
        pids = serving_pids(client, tmp_path / "serve.log")
        view = engine(client)
        folders = [Path(view["spare"]["directory"]), Path(view["fork_server"]["socket"]).parent]
        folders += [Path(row["socket"]).parent for row in view["workers"]]
    finally:
        client.close()
        process.kill()  # no shutdown: each notices the server is gone
        process.wait()
    for pid in pids:
        until(lambda pid=pid: not process_alive(pid), timeout_s=30)
    for folder in folders:  # nobody else is left to remove them
        until(lambda folder=folder: not folder.exists(), timeout_s=30)


def test_the_fork_server_runs_no_thread_of_its_own_after_forking(models_dir):
    process, client = start_serve(models_dir / "tiny-a", "--no-spare-worker")
    try:
        complete(client, "tiny-a")
        fork_server = engine(client)["fork_server"]
        assert fork_server["forked"] >= 1
        # One thread: PyTorch's pool was never started there (numpy's OpenBLAS pool, the only
        # other, stops itself at a fork and is never needed again).
        assert len(os.listdir(f"/proc/{fork_server['pid']}/task")) == 1
    finally:
        client.close()
        process.terminate()
        process.wait(timeout=60)


def test_a_forked_workers_answers_are_a_spawned_ones(models_dir):
    process, client = start_serve(models_dir / "tiny-a", "--no-spare-worker")
    try:
        forked = complete(client, "tiny-a")
        assert worker_row(client, "tiny-a")["forked"] is True
        os.kill(engine(client)["fork_server"]["pid"], signal.SIGKILL)
        until(lambda: engine(client)["fork_server"]["state"] == "gone")
        assert client.post("/api/models/tiny-a/unload").status_code == 200
        assert complete(client, "tiny-a") == forked
        assert worker_row(client, "tiny-a")["forked"] is False  # spawned: no fork server now
    finally:
        client.close()
        process.terminate()
        process.wait(timeout=60)


def test_a_model_loaded_again_reads_the_tokenizer_the_fork_server_parsed_ahead(
    models_dir, tmp_path
):
    log = tmp_path / "serve.log"
    process, client = start_serve(models_dir / "tiny-a", "--no-spare-worker", log=log)
    tokenizer = str((models_dir / "tiny-a" / "tokenizer.json").resolve())
    try:
        first = complete(client, "tiny-a")
        until(lambda: engine(client)["fork_server"]["tokenizers_kept"] == [tokenizer])
        assert "tokenizer parsed ahead" not in log.read_text()  # the first load parsed its own
        fork_server = engine(client)["fork_server"]["pid"]
        assert len(os.listdir(f"/proc/{fork_server}/task")) == 1  # parsing started no thread
        assert client.post("/api/models/tiny-a/unload").status_code == 200
        assert complete(client, "tiny-a") == first
        assert worker_row(client, "tiny-a")["forked"] is True
        assert "tokenizer parsed ahead" in log.read_text()
    finally:
        client.close()
        process.terminate()
        process.wait(timeout=60)


@pytest.mark.parametrize("flag", ["--in-process", "--no-spare-worker"])
def test_serve_keeps_no_spare_worker_in_process_or_when_told_not_to(models_dir, flag):
    process, client = start_serve(models_dir / "tiny-a", flag)
    try:
        assert engine(client)["spare"] is None
    finally:
        client.close()
        process.terminate()
        process.wait(timeout=60)


def test_serve_forks_no_worker_when_told_not_to(models_dir):
    process, client = start_serve(models_dir / "tiny-a", "--no-fork-server")
    try:
        assert engine(client)["fork_server"] is None
        assert worker_row(client, "tiny-a")["forked"] is False
        spare = until(lambda: (s := engine(client)["spare"])["state"] == "ready" and s)
        assert spare["forked"] is False  # spawned and warmed up as before
    finally:
        client.close()
        process.terminate()
        process.wait(timeout=60)
