"""Setting this process's autogroup nice: a write the kernel refuses for its rate limit (EAGAIN)
is retried without holding up the caller, the latest nice asked for is the one that lands, and
without an autogroup file nothing happens (the process runs as it would have)."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

import pytest

from modelhost.residency.workers import autogroup
from modelhost.residency.workers.autogroup import AutogroupNice

WAIT_S = 30.0


def until(condition, timeout_s: float = WAIT_S) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def retrying() -> bool:
    return any(thread.name == "autogroup-nice" for thread in threading.enumerate())


class StandInKernel:
    """An autogroup file whose writes are refused with EAGAIN while `refusals` lasts, then
    recorded in `written`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.refusals = 0
        self.written: list[str] = []
        self.lock = threading.Lock()  # the retrying thread writes while a test changes refusals

    def allow(self) -> None:
        with self.lock:
            self.refusals = 0


@pytest.fixture
def kernel(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    stand_in = StandInKernel(tmp_path / "autogroup")
    stand_in.path.touch()
    real_write = os.write

    def write(fd: int, data: bytes) -> int:
        if os.readlink(f"/proc/self/fd/{fd}") != str(stand_in.path):
            return real_write(fd, data)
        with stand_in.lock:
            if stand_in.refusals:
                stand_in.refusals -= 1
                raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")
            stand_in.written.append(data.decode())
            return len(data)

    monkeypatch.setattr(autogroup.os, "write", write)
    yield stand_in
    until(lambda: not retrying())


def test_a_nice_refused_for_the_rate_is_written_once_the_kernel_allows_it(kernel):
    kernel.refusals = 10**6
    AutogroupNice(kernel.path, retry_for_s=WAIT_S).set(10)
    assert kernel.written == [] and retrying()  # the caller did not wait for the kernel
    kernel.allow()
    until(lambda: kernel.written == ["10"])


def test_a_later_nice_wins_over_one_still_being_retried(kernel):
    kernel.refusals = 3
    nice = AutogroupNice(kernel.path, retry_for_s=WAIT_S)
    nice.set(10)
    nice.set(0)
    until(lambda: not retrying())
    assert kernel.written == ["0"]


def test_retrying_gives_up_after_its_bound(kernel):
    kernel.refusals = 10**6
    AutogroupNice(kernel.path, retry_for_s=0.1).set(10)
    until(lambda: not retrying())
    assert kernel.written == []


def test_without_an_autogroup_file_setting_a_nice_does_nothing(tmp_path):
    missing = tmp_path / "autogroup"
    AutogroupNice(missing).set(10)
    assert not missing.exists() and not retrying()
