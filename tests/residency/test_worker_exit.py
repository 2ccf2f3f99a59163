"""How a worker's end is waited for (supervisor.wait_exit) and how a worker ends once its server
has shut down (cli/worker.exit_at_once)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from modelhost.residency.workers.supervisor import wait_exit


def test_waiting_for_a_process_that_ends_returns_its_exit_status_and_reaps_it() -> None:
    process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(7)"])
    assert wait_exit(process, 60.0) == 7
    assert process.returncode == 7


def test_waiting_for_a_process_that_does_not_end_raises_timeout_expired() -> None:
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            wait_exit(process, 0.2)
        assert process.poll() is None
    finally:
        process.kill()
        process.wait()


def test_waiting_for_a_process_already_reaped_returns_its_status() -> None:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    assert wait_exit(process, 1.0) == 0


def test_a_worker_ending_at_once_still_runs_its_exit_handlers_and_waits_for_its_threads() -> None:
    script = textwrap.dedent(
        """
        import atexit, sys, threading, time
        from modelhost.cli.worker import exit_at_once

        def late():
            time.sleep(0.2)
            print("thread done", flush=True)

        threading.Thread(target=late).start()
        atexit.register(lambda: print("exit handler ran"))
        sys.stdout.write("buffered line\\n")
        exit_at_once(3)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 3
    assert done.stdout.splitlines() == ["buffered line", "thread done", "exit handler ran"]
