"""The spare worker pool on its own, with a stand-in worker module (no PyTorch): a warm spare
becomes the worker its arguments describe; a dead one is replaced and never handed out; closing
leaves no process."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from modelhost.residency.workers.spare_pool import SpareWorkers

MODULE = "spare_echo_worker"
WAIT_S = 60.0


def pool_for(
    tmp_path: Path, warm_s: float = 0.0, hold: Path | None = None, **options: float
) -> SpareWorkers:
    """`hold`: the worker a spare becomes runs until this file exists."""
    env = {
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path]),
        "SPARE_ECHO_OUT": str(tmp_path / "became.json"),
        "SPARE_ECHO_WARM_S": str(warm_s),
    }
    if hold is not None:
        env["SPARE_ECHO_HOLD"] = str(hold)
    return SpareWorkers(MODULE, env=env, **options)


async def until(condition, timeout_s: float = WAIT_S) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


def dead(pid: int) -> bool:
    """Ended: a zombie not yet reaped by its parent (the pool), or already reaped."""
    try:
        return "State:\tZ" in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True


def finish(handed: tuple[subprocess.Popen[bytes], Path]) -> int:
    """The handed worker's exit status, once it has ended; its directory is then removed, as
    the supervisor that owns it would."""
    process, directory = handed
    status = process.wait(timeout=WAIT_S)
    shutil.rmtree(directory)
    return status


async def hand_over_once(pool: SpareWorkers, *, warm: bool = True) -> int:
    """Waits for the pool's spare (`warm`: until it is warm), hands it over (waiting for its
    warm-up), lets the worker it became end, and returns its pid."""
    if warm:
        await until(lambda: pool.view()["state"] == "ready")
    else:
        await until(lambda: pool.view()["pid"] is not None)
    handed = await pool.hand_over([sys.executable, "-m", MODULE])
    assert handed is not None
    finish(handed)
    return handed[0].pid


def spare_nice_argument(pool: SpareWorkers) -> bytes:
    """The `--nice` the pool's spare was started with."""
    arguments = Path(f"/proc/{pool.view()['pid']}/cmdline").read_bytes().split(b"\0")
    return arguments[arguments.index(b"--nice") + 1]


def autogroup_nice(pid: int) -> int | None:
    """The nice of the process's autogroup (`/autogroup-N nice K`); None once it has ended."""
    try:
        return int(Path(f"/proc/{pid}/autogroup").read_text().split()[-1])
    except (OSError, ValueError, IndexError):
        return None


needs_autogroups = pytest.mark.skipif(
    not os.access("/proc/self/autogroup", os.W_OK),
    reason="no writable /proc/self/autogroup here (a kernel without CONFIG_SCHED_AUTOGROUP, "
    "or a container's read-only /proc)",
)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def test_a_warm_spare_becomes_the_worker_its_arguments_describe(tmp_path):
    pool = pool_for(tmp_path)
    pool.start()
    try:
        await until(lambda: pool.view()["state"] == "ready")
        spare_pid = pool.view()["pid"]
        assert pool.held_bytes() > 0  # its resident set, for the budget
        handed = await pool.hand_over([sys.executable, "-m", MODULE, "--model", "m.gguf"])
        assert handed is not None
        process, directory = handed
        assert process.pid == spare_pid
        assert oct(directory.stat().st_mode & 0o777) == oct(0o700)
        assert finish(handed) == 0
        became = json.loads((tmp_path / "became.json").read_text())
        assert became == {
            "argv": ["--model", "m.gguf", "--socket", str(directory / "worker.sock")],
            "pid": spare_pid,
        }
        assert pool.view() | {"handed": 1} == pool.view()
        assert pool.view()["state"] == "none"  # the next one waits for refill()
    finally:
        await pool.close()


async def test_the_next_spare_starts_on_refill(tmp_path):
    pool = pool_for(tmp_path)
    pool.start()
    try:
        handed_pid = await hand_over_once(pool)
        await asyncio.sleep(0.3)
        assert pool.view()["pid"] is None
        pool.refill()
        await until(lambda: pool.view()["state"] == "ready")
        assert pool.view()["pid"] != handed_pid
    finally:
        await pool.close()


async def test_a_spare_that_dies_is_never_handed_a_model_and_is_replaced(tmp_path):
    pool = pool_for(tmp_path)
    pool.start()
    try:
        await until(lambda: pool.view()["state"] == "ready")
        killed = pool.view()["pid"]
        os.kill(killed, signal.SIGKILL)
        await until(lambda: dead(killed))
        handed = await pool.hand_over([sys.executable, "-m", MODULE])
        if handed is not None:  # the pool had already replaced it: only the new one is handed
            assert handed[0].pid != killed
            assert finish(handed) == 0
        else:
            await until(lambda: pool.view()["pid"] not in (None, killed))
        assert pool.view()["died"] == 1
    finally:
        await pool.close()


async def test_a_spare_still_warming_is_waited_for_only_up_to_its_bound(tmp_path):
    pool = pool_for(tmp_path, warm_s=30.0, wait_s=0.3)
    pool.start()
    try:
        await until(lambda: pool.view()["pid"] is not None)
        assert await pool.hand_over([sys.executable, "-m", MODULE]) is None
        assert pool.view()["state"] == "starting"  # kept for the next load
    finally:
        await pool.close()


async def test_a_command_of_another_program_is_not_given_a_spare(tmp_path):
    pool = pool_for(tmp_path)
    pool.start()
    try:
        await until(lambda: pool.view()["state"] == "ready")
        assert await pool.hand_over([sys.executable, "-m", "another.module"]) is None
        assert pool.view()["state"] == "ready"
    finally:
        await pool.close()


@pytest.mark.parametrize("state", ["starting", "ready"])
async def test_closing_the_pool_leaves_no_process_and_no_directory(tmp_path, state):
    pool = pool_for(tmp_path, warm_s=30.0 if state == "starting" else 0.0)
    pool.start()
    await until(lambda: pool.view()["state"] == state)
    pid = pool.view()["pid"]
    spare = pool._spare
    assert spare is not None
    await pool.close()
    assert gone(pid)
    assert not spare.directory.exists()
    pool.refill()  # a closed pool keeps none
    await asyncio.sleep(0.3)
    assert pool.view()["pid"] is None


async def test_after_a_refill_the_next_spare_waits_until_a_model_has_answered(tmp_path):
    pool = pool_for(tmp_path)
    answered: list[float] = []
    pool.answered_since = lambda since: any(moment > since for moment in answered)
    pool.start()
    try:
        await until(lambda: pool.view()["state"] == "ready")  # the first one at once
        handed = await pool.hand_over([sys.executable, "-m", MODULE])
        assert handed is not None
        finish(handed)
        pool.refill()  # the load has ended
        await asyncio.sleep(0.5)
        assert pool.view()["pid"] is None  # the model has not answered yet
        answered.append(time.time())
        await until(lambda: pool.view()["pid"] is not None)
    finally:
        await pool.close()


@needs_autogroups
@pytest.mark.parametrize("state", ["starting", "ready"])
async def test_a_spare_warming_up_or_warm_runs_in_an_autogroup_at_nice_10(tmp_path, state):
    pool = pool_for(tmp_path, warm_s=30.0 if state == "starting" else 0.0)
    pool.start()
    try:
        await until(lambda: pool.view()["state"] == state)
        pid = pool.view()["pid"]
        await until(lambda: autogroup_nice(pid) == 10)
        assert pool.view()["state"] == state
    finally:
        await pool.close()


@needs_autogroups
async def test_the_worker_a_spare_becomes_runs_in_an_autogroup_at_nice_0(tmp_path):
    hold = tmp_path / "worker-may-exit"
    pool = pool_for(tmp_path, hold=hold)
    pool.start()
    handed = None
    try:
        await until(lambda: pool.view()["state"] == "ready")
        spare_pid = pool.view()["pid"]
        await until(lambda: autogroup_nice(spare_pid) == 10)
        handed = await pool.hand_over([sys.executable, "-m", MODULE])
        assert handed is not None
        await until(lambda: (tmp_path / "became.json").exists())  # its main() is running
        await until(lambda: autogroup_nice(spare_pid) == 0)
    finally:
        hold.touch()
        if handed is not None:
            assert finish(handed) == 0
        await pool.close()


@needs_autogroups
async def test_after_a_hand_over_that_found_no_warm_spare_the_next_warms_up_at_nice_0(tmp_path):
    pool = pool_for(tmp_path, warm_s=1.0)
    pool.start()
    try:
        await hand_over_once(pool, warm=False)  # waits for its warm-up
        assert pool.view()["urgent"] is True
        pool.refill()
        await until(lambda: pool.view()["pid"] is not None)
        pid = pool.view()["pid"]
        assert spare_nice_argument(pool) == b"0"
        await asyncio.sleep(0.3)  # a spare at nice 10 would have lowered its autogroup by now
        assert pool.view()["state"] == "starting"
        assert autogroup_nice(pid) == 0
    finally:
        await pool.close()


async def test_a_hand_over_that_finds_a_warm_spare_keeps_the_next_warm_up_low(tmp_path):
    pool = pool_for(tmp_path)
    pool.start()
    try:
        await hand_over_once(pool)
        assert pool.view()["urgent"] is False
        pool.refill()
        await until(lambda: pool.view()["pid"] is not None)
        assert spare_nice_argument(pool) == b"10"
    finally:
        await pool.close()
