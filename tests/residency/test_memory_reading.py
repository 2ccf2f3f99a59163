"""A process's memory as last read (residency/workers/memory_reading.py): a lease of a resident
model takes the last reading at once, and a stale one is read again off the request path."""

from __future__ import annotations

import threading
import time
from typing import Any, cast

from modelhost.residency.workers.memory_reading import LastReading
from modelhost.residency.workers.worker_unit import WorkerUnit

WAIT_S = 5.0


class Readings:
    """A /proc reading that counts its calls and answers the values it is given, in turn."""

    def __init__(self, *values: int) -> None:
        self.values = list(values)
        self.calls = 0
        self.release = threading.Event()
        self.release.set()

    def __call__(self) -> int:
        self.calls += 1
        self.release.wait(WAIT_S)
        return self.values[min(self.calls, len(self.values)) - 1]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def until(condition: Any) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_the_first_reading_is_taken_at_once():
    reading = LastReading(Readings(7))
    assert reading.last() == 7


def test_a_recent_reading_is_answered_without_reading_again():
    read, clock = Readings(7, 9), Clock()
    reading = LastReading(read, max_age_s=0.5, clock=clock)
    reading.last()
    clock.now += 0.4
    assert [reading.last(), reading.last()] == [7, 7]
    assert read.calls == 1


def test_a_stale_reading_is_answered_at_once_and_read_again_in_the_background():
    read, clock = Readings(7, 9), Clock()
    reading = LastReading(read, max_age_s=0.5, clock=clock)
    reading.last()
    clock.now += 0.6
    read.release.clear()  # the next reading takes as long as this test says
    assert reading.last() == 7  # the caller does not wait for it
    assert reading.last() == 7 and read.calls == 2  # one reading in flight, not one a call
    read.release.set()
    until(lambda: reading.last() == 9)


def test_a_background_reading_that_fails_leaves_the_last_one():
    clock = Clock()
    values = iter([7])
    reading = LastReading(lambda: next(values), max_age_s=0.5, clock=clock)  # then StopIteration
    reading.last()
    clock.now += 0.6
    assert reading.last() == 7
    until(lambda: reading._reading is not None and not reading._reading.is_alive())
    assert reading.last() == 7


def test_now_takes_a_current_reading():
    read = Readings(7, 9)
    reading = LastReading(read)
    reading.last()
    assert reading.now() == 9 and reading.last() == 9


class Worker:
    """A worker process as its unit sees it: only its memory."""

    def __init__(self, read: Readings) -> None:
        self.read = read

    def memory_bytes(self) -> int:
        return self.read()


async def test_a_worker_units_reading_is_the_last_one_and_refresh_takes_a_current_one():
    read = Readings(700, 900)
    unit = WorkerUnit("m", 500, cast(Any, Worker(read)))
    assert unit.measured_bytes() == 700
    assert unit.measured_bytes() == 700 and read.calls == 1
    await unit.refresh()
    assert unit.measured_bytes() == 900 and read.calls == 2


async def test_a_worker_units_reading_is_never_below_its_weights():
    unit = WorkerUnit("m", 500, cast(Any, Worker(Readings(300))))
    assert unit.measured_bytes() == 500
