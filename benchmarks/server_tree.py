"""A server under test as a process tree: started in its own session, its memory sampled from
/proc (children included: modelhost serves from worker processes), and stopped for certain.

Every tree started here is stopped when its `with` block ends, at interpreter exit, and on
SIGTERM/SIGHUP (turned into SystemExit so `finally` blocks run); Ctrl-C arrives as
KeyboardInterrupt and unwinds the same way.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

PAGE = os.sysconf("SC_PAGE_SIZE")
_LIVE: set[ServerTree] = set()


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        # comm may hold spaces and parentheses: the fields after it follow the last ')'
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    return children


def descendants(root: int) -> list[int]:
    """`root` and every process below it."""
    children, found, queue = _children_map(), [], [root]
    while queue:
        pid = queue.pop()
        found.append(pid)
        queue.extend(children.get(pid, ()))
    return found


def rss_bytes(pids: Sequence[int]) -> int:
    """Resident bytes of `pids`, summed (pages shared between them count once per process)."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
    return total


def pss_bytes(pids: Sequence[int]) -> int:
    """Proportional set size of `pids`, summed: shared pages split between their users."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, ValueError):
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
                    break
    return total


class ServerTree:
    """A started server: `peak_rss` since the last `reset_peak`, sampled every `interval_s`
    (the tree itself re-read every ten samples)."""

    def __init__(
        self, argv: Sequence[str], env: dict[str, str], log: Path, interval_s: float = 0.05
    ) -> None:
        self.argv, self.log = list(argv), log
        self.started = time.perf_counter()
        with open(log, "wb") as out:
            self.process = subprocess.Popen(
                self.argv,
                env=env,
                stdin=subprocess.DEVNULL,  # llama-server's router ends on its stdin's EOF signals
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        _LIVE.add(self)
        self.interval_s = interval_s
        self.peak_rss = 0
        self.last_rss = 0
        self._pids = [self.process.pid]
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def _sample(self) -> None:
        tick = 0
        while not self._stop.is_set():
            if tick % 10 == 0:
                self._pids = descendants(self.process.pid)
            self.last_rss = rss_bytes(self._pids)
            self.peak_rss = max(self.peak_rss, self.last_rss)
            tick += 1
            self._stop.wait(self.interval_s)

    def reset_peak(self) -> None:
        self.peak_rss = self.last_rss

    def tree(self) -> list[int]:
        return descendants(self.process.pid)

    def rss_now(self) -> int:
        return rss_bytes(self.tree())

    def pss_now(self) -> int:
        return pss_bytes(self.tree())

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM to the session's process group and to every descendant (a worker may have
        left the group), SIGKILL to whatever is left after `grace_s`."""
        self._stop.set()
        pids = self.tree() if self.alive() else []
        self._signal(pids, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(grace_s)
        leftover = [pid for pid in pids if _exists(pid)]
        self._signal(leftover + [self.process.pid], signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5)
        _LIVE.discard(self)

    def _signal(self, pids: Sequence[int], sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, sig)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    def __enter__(self) -> ServerTree:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stop_all() -> None:
    for tree in list(_LIVE):
        tree.stop(grace_s=5.0)


def _exit_on_signal(signum: int, _frame: object) -> None:
    sys.exit(128 + signum)


def install_cleanup() -> None:
    """Stop every live tree at exit, and exit (unwinding `finally`) on SIGTERM and SIGHUP, and
    on SIGINT even where the shell started us with it ignored (a background job)."""
    atexit.register(_stop_all)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGHUP, _exit_on_signal)
