"""The fork server with a stand-in worker module (no PyTorch): the supervisor's workers and the
pool's spares come from it, and are reaped, restarted, measured and removed as spawned ones are;
without it (gone, or another program) a worker is spawned."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from modelhost.residency.workers.forks import ForkServerHandle, fork_server_supported
from modelhost.residency.workers.spare_pool import SpareWorkers
from modelhost.residency.workers.supervisor import WorkerProcess, pss_bytes, rss_bytes

pytestmark = pytest.mark.skipif(not fork_server_supported(), reason="the fork server needs Linux")
MODULE = "forked_stand_in"
COMMAND = [sys.executable, "-m", MODULE]
WAIT_S = 60.0
BALLAST_MB = 64
ENV = {"PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}


def running(pid: int) -> bool:
    """Running: neither ended nor a zombie waiting to be reaped."""
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


async def until(condition, timeout_s: float = WAIT_S) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


@pytest.fixture
async def forks() -> AsyncIterator[ForkServerHandle]:
    handle = ForkServerHandle(MODULE, env={**ENV, "BALLAST_MB": str(BALLAST_MB)})
    handle.start()
    assert handle.process is not None
    pid = handle.process.pid
    try:
        await until(lambda: handle.view()["state"] == "ready")
        yield handle
    finally:
        await asyncio.to_thread(handle.close)
    assert not running(pid), "the fork server outlived its close()"


def worker(forks: ForkServerHandle | None, **options: float) -> WorkerProcess:
    env = forks.env if forks is not None else ENV
    return WorkerProcess(COMMAND, start_timeout_s=WAIT_S, env=env, forks=forks, **options)  # type: ignore[arg-type]


async def test_a_worker_forked_runs_in_a_session_of_its_own_and_its_stop_leaves_nothing(forks):
    process = worker(forks)
    await process.start()
    pid, directory = process.pid, Path(process.socket_path).parent
    assert pid is not None and process.forked
    assert os.getpgid(pid) == pid and os.getsid(pid) == pid  # as a spawned worker: its own group
    assert oct(directory.stat().st_mode & 0o777) == oct(0o700)
    await process.stop()
    assert not running(pid)
    assert not directory.exists()
    assert forks.view()["forked"] == 1


async def test_a_forked_worker_killed_is_seen_dead_reaped_and_restarted_from_the_fork_server(
    forks,
):
    process = worker(forks)
    await process.start()
    first, directory = process.pid, Path(process.socket_path).parent
    assert first is not None
    os.kill(first, signal.SIGKILL)
    await until(lambda: not process.alive())
    assert process.process is not None and process.process.returncode == -signal.SIGKILL
    assert not running(first)  # the fork server reaped it: no zombie left
    assert await process.ensure_alive()
    assert process.pid != first and process.forked and process.restarts == 1
    assert not directory.exists()  # the dead worker's socket folder went with it
    await process.stop()


async def test_a_forked_worker_out_of_restarts_is_exhausted(forks):
    process = worker(forks, max_restarts=1)
    await process.start()
    for _ in range(2):
        pid = process.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        await until(lambda: not process.alive())
        restarted = await process.ensure_alive()
    assert restarted is False and process.exhausted()
    await process.stop()


async def test_the_budget_counts_the_pages_a_forked_worker_shares_with_the_fork_server_once(
    forks,
):
    process = worker(forks)
    await process.start()
    try:
        pid, server = process.pid, forks.process
        assert pid is not None and server is not None
        ballast = BALLAST_MB << 20
        rss_child, rss_server = rss_bytes(pid), rss_bytes(server.pid)
        assert rss_child is not None and rss_server is not None
        assert min(rss_child, rss_server) > ballast  # each maps the ballast
        counted = (process.memory_bytes() or 0) + forks.held_bytes()
        assert process.memory_bytes() == pss_bytes(pid)
        assert counted < rss_child + rss_server - ballast * 0.8  # the ballast once, not twice
        assert counted > ballast
    finally:
        await process.stop()


async def test_a_forked_worker_keeps_serving_when_the_fork_server_dies_and_the_next_is_spawned(
    forks,
):
    process = worker(forks)
    await process.start()
    first = process.pid
    assert forks.process is not None and first is not None
    os.kill(forks.process.pid, signal.SIGKILL)
    await until(lambda: not forks.alive())
    await asyncio.sleep(0.3)
    assert process.alive() and running(first)
    os.kill(first, signal.SIGKILL)
    await until(lambda: not process.alive())
    assert await process.ensure_alive()
    assert process.pid != first and not process.forked  # spawned: the fork server is gone
    await process.stop()


def kept_in(process: WorkerProcess) -> str:
    transport = httpx.HTTPTransport(uds=process.socket_path)
    with httpx.Client(transport=transport, base_url="http://worker") as client:
        return client.get("/health").headers["x-kept"]


async def test_what_the_fork_server_keeps_is_in_the_workers_it_forks_after(forks):
    assert forks.view()["tokenizers_kept"] == []
    assert await forks.keep("model-a")
    assert forks.view()["tokenizers_kept"] == ["model-a"]
    process = worker(forks)
    await process.start()
    try:
        assert await asyncio.to_thread(kept_in, process) == "model-a"
    finally:
        await process.stop()


async def test_a_keep_that_fails_answers_false_and_the_fork_server_forks_on(forks):
    assert not await forks.keep("fail")
    assert forks.view()["tokenizers_kept"] == []
    process = worker(forks)
    await process.start()
    try:
        assert process.forked and await asyncio.to_thread(kept_in, process) == ""
    finally:
        await process.stop()


async def test_a_command_of_another_program_or_environment_is_spawned(forks):
    assert await forks.fork([sys.executable, "-m", "another.module"], forks.env) is None
    assert await forks.fork(COMMAND, {**forks.env, "OTHER": "1"}) is None
    assert forks.view()["forked"] == 0


@pytest.fixture
async def echo_pool(tmp_path) -> AsyncIterator[SpareWorkers]:
    """A spare pool whose spares are forked from a fork server of `spare_echo_worker`."""
    env = {**ENV, "SPARE_ECHO_OUT": str(tmp_path / "became.json")}
    forks = ForkServerHandle("spare_echo_worker", env=env)
    forks.start()
    pool = SpareWorkers("spare_echo_worker", env=env, forks=forks)
    pool.start()
    try:
        yield pool
    finally:
        await pool.close()
        await asyncio.to_thread(forks.close)


def ready_forked(pool: SpareWorkers) -> bool:
    return pool.view()["state"] == "ready" and pool.view()["forked"] is True


async def test_a_forked_spare_handed_a_model_runs_the_warm_modules_main(tmp_path, echo_pool):
    await until(lambda: ready_forked(echo_pool))
    spare_pid = echo_pool.view()["pid"]
    assert echo_pool.held_bytes() == pss_bytes(spare_pid)
    command = [sys.executable, "-m", "spare_echo_worker", "--model", "m"]
    handed = await echo_pool.hand_over(command)
    assert handed is not None
    process, directory = handed
    assert process.pid == spare_pid
    assert await asyncio.to_thread(process.wait, WAIT_S) == 0
    became = json.loads((tmp_path / "became.json").read_text())
    assert became == {"argv": ["--model", "m", "--socket", str(directory / "worker.sock")],
                      "pid": spare_pid}  # fmt: skip


async def test_a_forked_spare_killed_is_replaced_and_closing_the_pool_leaves_no_process(
    echo_pool,
):
    await until(lambda: ready_forked(echo_pool))
    killed = echo_pool.view()["pid"]
    directory = echo_pool._spare.directory  # type: ignore[union-attr]
    os.kill(killed, signal.SIGKILL)
    await until(lambda: echo_pool.view()["pid"] not in (None, killed) and ready_forked(echo_pool))
    assert echo_pool.view()["died"] == 1
    assert not running(killed) and not directory.exists()
    replacement = echo_pool.view()["pid"]
    await echo_pool.close()
    assert not running(replacement)
