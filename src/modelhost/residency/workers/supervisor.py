"""One worker process's life: spawn it, wait until it answers, measure it, stop it, respawn it.

The worker is whatever program `command` runs, told where to listen with `--socket PATH`. It runs
in its own process group (so a stop reaches anything it started) and listens on
`<dir>/worker.sock`, the directory made here with mode 0700 and removed when the worker stops.
Its first start may take a spare worker instead of a new process (`spares`, spare_pool.py): a
Python that has imported PyTorch and the rest already, in a directory made the same way. A new
process is forked by the fork server where there is one (`forks`, forks.py), and spawned
where not: a forked one is stopped, reaped, restarted and measured as a spawned one (its
end told by a pidfd, its memory counted as its PSS).
A dead worker is respawned on demand (a new process), at most `MAX_RESTARTS` times in
`RESTART_WINDOW_S` (`RestartWindow`, the one rule a cluster's actors are restarted by too); past
that the supervisor reports itself exhausted and the host evicts the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import shutil
import signal
import subprocess
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

import httpx

from modelhost.residency.unit import LoadProgress
from modelhost.residency.workers.private_socket import private_directory
from modelhost.residency.workers.spare_process import TAKEN_FILE

if TYPE_CHECKING:
    from modelhost.residency.workers.forks import ForkedProcess, ForkServerHandle
    from modelhost.residency.workers.spare_pool import SpareWorkers

    # A worker's process: spawned here, or forked by the fork server (forks.py), which offers
    # the same surface (pid, poll, wait, returncode, stdin).
    WorkerPid: TypeAlias = subprocess.Popen[bytes] | ForkedProcess

MAX_RESTARTS = 3
RESTART_WINDOW_S = 60.0
START_TIMEOUT_S = 120.0  # without news: a load that reports progress may take longer
STOP_TIMEOUT_S = 5.0
# Beside the socket, the worker writes the fraction of its weights loaded (write_load_progress).
PROGRESS_FILE = "load-progress"
SOCKET_NAME = "worker.sock"
# Between looks for a starting worker's socket: a look is a poll and a small file read, and the
# socket appears only once the engine is built, so a short nap costs nothing and a switch waits
# on average half of it (50 ms made ~25 ms of every switch's `listen_ms`).
HEALTH_POLL_S = 0.01


class WorkerFailed(RuntimeError):
    """The worker exited, or did not answer, before it became healthy."""


def rss_bytes(pid: int) -> int | None:
    """The process's resident set (VmRSS in /proc/<pid>/status), or None when it is gone."""
    return proc_bytes(f"/proc/{pid}/status", "VmRSS:")


def pss_bytes(pid: int) -> int | None:
    """The process's proportional set (Pss in /proc/<pid>/smaps_rollup): each page it shares
    with other processes counted as its share (a forked process's pages shared with the fork
    server); its RSS where the kernel has no such file (before Linux 4.14), None when gone."""
    pss = proc_bytes(f"/proc/{pid}/smaps_rollup", "Pss:")
    return pss if pss is not None else rss_bytes(pid)


def proc_bytes(path: str, field: str) -> int | None:
    """A `field: N kB` line of a /proc file, in bytes (None: no such file or line)."""
    try:
        with open(path, encoding="ascii", errors="replace") as lines:
            for line in lines:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class RestartWindow:
    """At most `limit` restarts in any `window_s` seconds. Its restarts travel as ages (seconds
    ago), so a worker started afresh elsewhere (a cluster's new actor for a model whose actor
    died) carries on the same count instead of starting a new one."""

    def __init__(
        self,
        limit: int = MAX_RESTARTS,
        window_s: float = RESTART_WINDOW_S,
        ages: Iterable[float] = (),
    ) -> None:
        self.limit = limit
        self.window_s = window_s
        self.count = 0  # restarts recorded here, ever (the views' `restarts`)
        now = time.monotonic()
        self._times: deque[float] = deque(sorted(now - age for age in ages))

    def allows(self) -> bool:
        """Another restart is within the rule now."""
        self._forget_old()
        return len(self._times) < self.limit

    def record(self) -> None:
        self._times.append(time.monotonic())
        self.count += 1

    def ages(self) -> list[float]:
        """The restarts still inside the window, as seconds ago."""
        self._forget_old()
        now = time.monotonic()
        return [now - moment for moment in self._times]

    def _forget_old(self) -> None:
        now = time.monotonic()
        while self._times and now - self._times[0] > self.window_s:
            self._times.popleft()


class WorkerProcess:
    def __init__(
        self,
        command: Sequence[str] | Callable[[], Sequence[str]],
        *,
        start_timeout_s: float = START_TIMEOUT_S,
        max_restarts: int = MAX_RESTARTS,
        restart_window_s: float = RESTART_WINDOW_S,
        env: Mapping[str, str] | None = None,
        progress: LoadProgress | None = None,
        restart_ages: Sequence[float] = (),
        spares: SpareWorkers | None = None,
        forks: ForkServerHandle | None = None,
    ) -> None:
        # The command, or what gives it at each start: a restart runs the command as it is
        # then (the LoRA adapters loaded since the first start among its arguments).
        self._command = command if callable(command) else lambda: command
        self.env = dict(env or {})  # added to this process's environment
        self.progress = progress  # told how far the first load has got
        self.start_timeout_s = start_timeout_s
        # `restart_ages`: restarts this model had before this worker (RestartWindow.ages).
        self.restart_window = RestartWindow(max_restarts, restart_window_s, restart_ages)
        self.process: WorkerPid | None = None
        self.directory: Path | None = None
        self.state = "new"
        self.spares = spares  # where the first start may find a warm process
        self.from_spare = False  # whether the running process was a spare
        self.forks = forks  # where a new process is forked from (None or gone: spawned)
        self.spawned_at = 0.0
        self._lock = asyncio.Lock()

    @property
    def command(self) -> list[str]:
        """What this worker runs now (`--socket PATH` follows)."""
        return list(self._command())

    @property
    def socket_path(self) -> str:
        assert self.directory is not None
        return str(self.directory / SOCKET_NAME)

    @property
    def restarts(self) -> int:
        return self.restart_window.count

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def forked(self) -> bool:
        """Whether the running process came from the fork server (as a worker or a spare)."""
        return self.process is not None and not isinstance(self.process, subprocess.Popen)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def exhausted(self) -> bool:
        """Dead, and out of restarts for now."""
        return not self.alive() and self.state != "stopped" and not self.restart_window.allows()

    async def start(self) -> None:
        async with self._lock:
            await self._start(spare=True)

    async def ensure_alive(self) -> bool:
        """Respawn a dead worker when restarts allow; True when a live worker is there."""
        async with self._lock:
            if self.alive():
                return True
            if self.state == "stopped" or not self.restart_window.allows():
                return False
            self.restart_window.record()
            await asyncio.to_thread(self._reap)
            try:
                await self._start()
            except WorkerFailed:
                return False
            return True

    async def _start(self, spare: bool = False) -> None:
        self.state = "starting"
        now = self.command
        handed = await self.spares.hand_over(now) if spare and self.spares else None
        self.from_spare = handed is not None
        self.spawned_at = time.time()  # wall clock: the worker's startup marks are too
        if handed is not None:
            self.process, self.directory = handed
        else:
            self.directory = private_directory()
            command = [*now, "--socket", self.socket_path]
            forked = await self.forks.fork(command, self.env) if self.forks else None
            if forked is not None:
                self.process = forked
            else:
                env = {**os.environ, **self.env} if self.env else None
                self.process = subprocess.Popen(
                    command, start_new_session=True, stdin=subprocess.DEVNULL, env=env
                )
        try:
            await self._wait_healthy()
        except WorkerFailed:
            lost_spare = self.from_spare and not self._spare_took_over()  # before the reap
            await asyncio.to_thread(self._reap)
            if lost_spare:  # it died as it was handed its arguments: start afresh
                assert self.spares is not None
                self.spares.lost(self.process)
                await self._start()
                return
            self.state = "failed"
            raise
        except BaseException:
            await asyncio.to_thread(self._reap)
            self.state = "failed"
            raise
        self.state = "ready"

    def _spare_took_over(self) -> bool:
        """Whether the spare read its worker's arguments (from then on, failing is the
        worker's; one that died before did not fail a load)."""
        assert self.directory is not None
        return (self.directory / TAKEN_FILE).exists()

    async def _wait_healthy(self) -> None:
        """Until the worker answers /health: it fails if the worker exits, or if
        `start_timeout_s` pass with neither an answer nor progress in its load."""
        deadline = time.monotonic() + self.start_timeout_s
        progress_file = Path(self.socket_path).with_name(PROGRESS_FILE)
        seen: float | None = None
        transport = httpx.AsyncHTTPTransport(uds=self.socket_path)
        async with httpx.AsyncClient(transport=transport, base_url="http://worker") as client:
            while True:
                assert self.process is not None
                code = self.process.poll()
                if code is not None:
                    raise WorkerFailed(f"the worker exited with status {code} while loading")
                # Read before asking: a worker that answers has written its last fraction.
                fraction = read_load_progress(progress_file)
                if fraction is not None and fraction != seen:
                    seen, deadline = fraction, time.monotonic() + self.start_timeout_s
                    if self.progress is not None:
                        self.progress.report(fraction)
                if os.path.exists(self.socket_path):
                    with contextlib.suppress(httpx.TransportError):
                        response = await client.get("/health", timeout=5.0)
                        if response.status_code == 200:
                            return
                if time.monotonic() > deadline:
                    raise WorkerFailed(f"the worker did not answer in {self.start_timeout_s:.0f} s")
                await asyncio.sleep(HEALTH_POLL_S)

    async def wait_dead(self, timeout_s: float) -> bool:
        """True when the worker has exited (or does within `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while self.alive():
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    def memory_bytes(self) -> int | None:
        """What the worker holds: its RSS, or for a forked one its PSS (the pages it shares
        with the fork server are counted once, beside the fork server's); None when dead."""
        if not self.alive() or self.process is None:
            return None
        return pss_bytes(self.process.pid) if self.forked else rss_bytes(self.process.pid)

    async def stop(self) -> None:
        async with self._lock:
            self.state = "stopped"
            await asyncio.to_thread(self._reap)

    def kill_now(self) -> None:
        """SIGKILL the worker's group without waiting (a forced shutdown; any thread)."""
        if self.alive() and self.process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)

    def _reap(self) -> None:
        """SIGTERM the group, SIGKILL it after STOP_TIMEOUT_S, and remove the socket's dir."""
        if self.process is not None:
            end_group(self.process)
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)


def end_group(process: WorkerPid) -> None:
    """SIGTERM the process's group (it leads its own session), SIGKILL it after
    STOP_TIMEOUT_S, and reap it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        wait_exit(process, STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=STOP_TIMEOUT_S)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)  # anything the process left in its group


def wait_exit(process: WorkerPid, timeout_s: float) -> int:
    """`process.wait(timeout_s)`, told of the exit by the kernel where it can be (a pidfd turns
    readable when the process ends) instead of polling, whose naps grow to 50 ms: a drain's
    next load starts the moment the old worker's memory is back."""
    if (
        isinstance(process, subprocess.Popen)
        and process.returncode is None
        and hasattr(os, "pidfd_open")
    ):  # (a forked process's own wait is told by its pidfd already)
        try:
            pidfd = os.pidfd_open(process.pid)
        except OSError:  # an older kernel, or the process already reaped
            pass
        else:
            try:
                select.select([pidfd], [], [], timeout_s)
            finally:
                os.close(pidfd)
            return process.wait(timeout=0)  # reaps it, or raises TimeoutExpired as wait does
    return process.wait(timeout=timeout_s)


def write_load_progress(path: Path, fraction: float) -> None:
    """The worker's side: `fraction` into `path`, replaced whole (the parent never reads half)."""
    partial = path.with_suffix(".partial")
    partial.write_text(f"{fraction:.4f}")
    partial.replace(path)


def read_load_progress(path: Path) -> float | None:
    with contextlib.suppress(OSError, ValueError):
        return float(path.read_text())
    return None
