"""The nice of this process's autogroup: the only nice that lowers a process against processes
in other sessions where Linux groups sessions for the scheduler.

With `kernel.sched_autogroup_enabled` = 1 (most Linux desktops), every session (setsid) is an
autogroup, and the scheduler shares the CPU between autogroups first, then between the threads
inside each: a thread's own nice counts only against threads of its own session. A spare worker
runs in a session of its own, so its warm-up at thread nice 10 still took half the CPU from a
worker answering in another session. Writing a nice to /proc/self/autogroup weighs the whole
session instead.

What the kernel allows (kernel/sched/autogroup.c, `proc_sched_autogroup_set_nice`): a positive
nice or 0 to anyone, a negative one only with CAP_SYS_NICE; and without CAP_SYS_ADMIN, one
write per 100 ms across the whole system (EAGAIN), counting privileged writers' too. So a write
refused for the rate is tried again on a daemon thread for a while, never holding up its
caller; any other failure (no file without CONFIG_SCHED_AUTOGROUP or off Linux, a read-only
/proc in a container, a denied write) leaves the process as it was, which is how it runs
anyway where sessions are not grouped.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

AUTOGROUP_FILE = Path("/proc/self/autogroup")
RETRY_INTERVAL_S = 0.025  # the kernel's limit is one write per 100 ms
RETRY_FOR_S = 1.0


class AutogroupNice:
    """Sets the nice of the autogroup this process is in (with every process of its session)."""

    def __init__(self, path: Path = AUTOGROUP_FILE, *, retry_for_s: float = RETRY_FOR_S) -> None:
        self.path = path
        self.retry_for_s = retry_for_s
        self._lock = threading.Lock()
        self._wanted = 0  # the nice last asked for: what a retry writes
        self._retrying = False

    def set(self, nice: int) -> None:
        """Ask for `nice` (0 to 19); returns at once, a thread retrying a write refused for
        the rate. A later call wins over an earlier one still being retried."""
        with self._lock:
            self._wanted = nice
            if self._retrying or not self._refused_for_rate(nice):
                return
            self._retrying = True
        threading.Thread(target=self._retry, name="autogroup-nice", daemon=True).start()

    def _retry(self) -> None:
        deadline = time.monotonic() + self.retry_for_s
        while True:
            time.sleep(RETRY_INTERVAL_S)
            with self._lock:
                if not self._refused_for_rate(self._wanted) or time.monotonic() > deadline:
                    self._retrying = False
                    return

    def _refused_for_rate(self, nice: int) -> bool:
        """Write `nice`; True only when the kernel asks to try again later (EAGAIN)."""
        try:
            fd = os.open(self.path, os.O_WRONLY)
        except OSError:
            return False
        try:
            os.write(fd, str(nice).encode())
        except OSError as exc:
            return exc.errno == errno.EAGAIN
        finally:
            os.close(fd)
        return False
