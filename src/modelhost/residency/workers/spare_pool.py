"""One spare worker kept warm, so that a switch to a model that is not resident costs loading its
weights, not starting Python and importing PyTorch (seconds on a small machine).

The spare is a process of `spare_process.py`: it has imported the worker's module and run its
`warm_up()`, and waits on its stdin for the worker's arguments. `hand_over(command)` gives those
to a ready spare (waiting up to `wait_s` for one still warming up: it is ahead of a process
started now) and returns the process and its private directory (0700) for the supervisor to
treat as the worker it started itself. After a hand-over the next spare is wanted once the
host has ended that load (`follow(host)`), and starts once a model has answered a request since,
or `REFILL_AFTER_S` at the latest: the first prefill of the model just loaded does not share the
CPU with a warm-up (on two cores it would take a third longer); the warm-up itself runs at a low
priority, behind any model answering: the spare's session (its autogroup, where Linux groups
sessions) and its warm-up thread at nice 10, the worker it becomes at 0 (spare_process.py).
Where a hand-over finds no warm spare (switches coming back to back, with no idle moment for a
low-priority warm-up), the next spares warm up at the usual priority instead (`urgent`), until
a hand-over finds one that has waited `REFILL_AFTER_S` since it was warm: each then shares the
CPU with the requests after a switch, rather than adding its whole warm-up to the next one.

Where `modelhost serve` runs a fork server (forks.py), a spare is forked from it instead: warm
at once, for the cost of a fork, with no warm-up to compete with anything (the priorities above
are then moot); where the fork server is gone, spares are spawned and warm up as above.

A spare that dies is reaped and replaced, never handed a model (at most `max_restarts` deaths
in `restart_window_s`, the rule workers follow). `close()` stops it with the server; a server
that dies without closing leaves it nothing either: its stdin ends and it exits. Its resident
set is `held_bytes()`, which `modelhost serve` counts against the model budget.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modelhost.residency.workers.private_socket import private_directory
from modelhost.residency.workers.spare_process import WARM_UP_NICE
from modelhost.residency.workers.supervisor import (
    MAX_RESTARTS,
    RESTART_WINDOW_S,
    SOCKET_NAME,
    RestartWindow,
    end_group,
    pss_bytes,
    rss_bytes,
)

if TYPE_CHECKING:
    from modelhost.residency.host import ResidencyHost
    from modelhost.residency.workers.forks import ForkServerHandle
    from modelhost.residency.workers.supervisor import WorkerPid

log = logging.getLogger("modelhost.models")

SPARE_WAIT_S = 30.0  # a spare still warming up is waited for this long, then a new process starts
REFILL_AFTER_S = 30.0  # after a refill, a spare starts when a model has answered, or after this
READY_FILE = "spare-ready"  # in the spare's directory, once warm
WATCH_INTERVAL_S = 0.1


class Spare:
    """One spare process and the directory it will serve its socket from."""

    def __init__(self, process: WorkerPid, directory: Path) -> None:
        self.process = process
        self.directory = directory
        self.started_at = time.monotonic()
        self.warm_s: float | None = None  # seconds from its start until it was warm

    @property
    def forked(self) -> bool:
        """Whether the fork server forked it (warm at once), rather than it being spawned."""
        return not isinstance(self.process, subprocess.Popen)

    @property
    def state(self) -> str:
        return "ready" if self.warm_s is not None else "starting"

    def alive(self) -> bool:
        return self.process.poll() is None

    def check_warm(self) -> None:
        if self.warm_s is None and (self.directory / READY_FILE).exists():
            self.warm_s = time.monotonic() - self.started_at

    def become(self, arguments: Sequence[str]) -> bool:
        """Hand the spare its worker's arguments; False when it is gone."""
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(json.dumps(list(arguments)).encode() + b"\n")
            self.process.stdin.close()
        except OSError:
            return False
        return True

    def discard(self) -> None:
        """Stop the process (its stdin ends first, so a waiting spare exits at once) and
        remove its directory. Blocking: call it from a thread."""
        if self.process.stdin is not None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()
        end_group(self.process)
        shutil.rmtree(self.directory, ignore_errors=True)


class SpareWorkers:
    def __init__(
        self,
        module: str,
        *,
        env: Mapping[str, str] | None = None,
        wait_s: float = SPARE_WAIT_S,
        max_restarts: int = MAX_RESTARTS,
        restart_window_s: float = RESTART_WINDOW_S,
        forks: ForkServerHandle | None = None,
    ) -> None:
        """`module`: the worker's (`python -m module ...` is the command a spare stands in
        for); `env`: added to the spare's environment, as to a worker's; `forks`: the fork
        server spares are forked from while it runs (spawned otherwise)."""
        self.module = module
        self.forks = forks
        self.command_prefix = [sys.executable, "-m", module]
        self.env = dict(env or {})
        self.wait_s = wait_s
        self.deaths = RestartWindow(max_restarts, restart_window_s)
        self.handed = 0  # spares that became workers
        # Whether any model has answered a request since the given time.time() (follow()):
        # without a host to ask, the next spare starts at once.
        self.answered_since: Callable[[float], bool] = lambda since: True
        self._spare: Spare | None = None
        # Whether switches come back to back (`_back_to_back`): the next spare then warms up at
        # the usual priority.
        self.urgent = False
        self._wanted = False
        self._wanted_since = 0.0  # time.time() of the last refill (0: at once)
        self._closed = False
        self._watch: asyncio.Task[None] | None = None

    # -- the server's side -----------------------------------------------------------------

    def start(self) -> None:
        """Keep a spare from now on, the first one at once (in a running event loop)."""
        self._want(since=0.0)

    def follow(self, host: ResidencyHost[Any]) -> None:
        """Refill after each load `host` ends (or fails), and ask it whether a model has
        answered since: a lease released after that moment moved the model's last use."""

        def on_event(name: str, payload: dict[str, Any]) -> None:
            if name == "model.load" and payload.get("phase") in ("finished", "failed"):
                self.refill()

        host.subscribe(on_event)
        self.answered_since = lambda since: any(m.last_used_at > since for m in host.resident())

    def refill(self) -> None:
        """A spare is wanted again (after a hand-over, once that load has ended): it starts
        once a model has answered since, or `REFILL_AFTER_S` from now."""
        self._want(since=time.time())

    def _want(self, since: float) -> None:
        if self._closed:
            return
        self._wanted, self._wanted_since = True, since
        if self._watch is None:
            self._watch = asyncio.get_running_loop().create_task(self._keep())

    async def close(self) -> None:
        """Stop the spare and keep none from now on."""
        self._closed = True
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        spare, self._spare = self._spare, None
        if spare is not None:
            await asyncio.to_thread(spare.discard)

    def held_bytes(self) -> int:
        """The spare's memory now (0 without one): its RSS, or its PSS when forked (the pages
        it shares with the fork server are counted once, beside the fork server's)."""
        spare = self._spare
        if spare is None:
            return 0
        return ((pss_bytes if spare.forked else rss_bytes)(spare.process.pid)) or 0

    def view(self) -> dict[str, Any]:
        """The spare for `GET /engine`."""
        spare = self._spare
        row: dict[str, Any] = {"state": spare.state if spare is not None else "none"}
        row["pid"] = spare.process.pid if spare is not None else None
        row["directory"] = str(spare.directory) if spare is not None else None
        row["rss_bytes"] = self.held_bytes() if spare is not None else None
        row["warm_s"] = spare.warm_s if spare is not None else None
        row["forked"] = spare is not None and spare.forked
        row["urgent"] = self.urgent
        return {**row, "handed": self.handed, "died": self.deaths.count}

    # -- the supervisor's side -------------------------------------------------------------

    async def hand_over(self, command: Sequence[str]) -> tuple[WorkerPid, Path] | None:
        """A warm process running `command` (`--socket` in its directory added), with that
        directory; None when there is no spare to give (start one afresh)."""
        if self._closed or list(command[: len(self.command_prefix)]) != self.command_prefix:
            return None
        deadline = time.monotonic() + self.wait_s
        self._check()
        self.urgent = self._back_to_back(self._spare)
        while True:
            spare = self._spare
            if spare is None or self._closed:
                return None
            if spare.state == "ready":
                break
            if time.monotonic() > deadline:
                log.info("[models] the spare worker is not warm yet: starting a new process")
                return None
            await asyncio.sleep(WATCH_INTERVAL_S / 2)
            self._check()
        self._spare, self._wanted = None, False  # the next one starts on refill()
        arguments = [*command[len(self.command_prefix) :], "--socket"]
        arguments.append(str(spare.directory / SOCKET_NAME))
        if not spare.become(arguments):
            log.warning("[models] the spare worker (pid %d) ended as it was handed a model",
                        spare.process.pid)  # fmt: skip
            self.deaths.record()
            await asyncio.to_thread(spare.discard)
            self._want(since=0.0)
            return None
        self.handed += 1
        log.info("[models] spare worker (pid %d) takes the load", spare.process.pid)
        return spare.process, spare.directory

    def lost(self, process: WorkerPid) -> None:
        """A spare handed over that ended before it read its arguments (its death was not
        seen in time to keep it from the load): it counts among the spares that died."""
        self.deaths.record()
        log.warning("[models] the spare worker (pid %d) had ended before it took the load "
                    "(status %s); a new process starts instead",
                    process.pid, process.returncode)  # fmt: skip

    # -- keeping one -----------------------------------------------------------------------

    async def _keep(self) -> None:
        while not self._closed:
            self._check()
            if self._spare is None and self._wanted and self.deaths.allows() and self._due():
                spare = await self._start_one()
                if self._closed:  # closed while it started
                    await asyncio.to_thread(spare.discard)
                    return
                self._spare = spare
            await asyncio.sleep(WATCH_INTERVAL_S)

    def _back_to_back(self, spare: Spare | None) -> bool:
        """Whether switches now come faster than a low-priority warm-up ends: this one finds no
        warm spare; or, once they have, the spare it finds has not waited `REFILL_AFTER_S`
        since it was warm (urgent warm-ups keep up with the switches, which go on)."""
        if spare is None or spare.warm_s is None:
            return True
        if not self.urgent:
            return False
        return time.monotonic() - (spare.started_at + spare.warm_s) < REFILL_AFTER_S

    def _due(self) -> bool:
        since = self._wanted_since
        return not since or time.time() - since > REFILL_AFTER_S or self.answered_since(since)

    def _check(self) -> None:
        """Notice the spare warming up, or dying (reaped, and replaced by `_keep`)."""
        spare = self._spare
        if spare is None:
            return
        if not spare.alive():
            self._spare, self._wanted_since = None, 0.0  # its replacement starts at once
            self.deaths.record()
            log.warning("[models] spare worker (pid %d) exited with status %s; replacing it",
                        spare.process.pid, spare.process.returncode)  # fmt: skip
            spare.discard()  # already dead: this only reaps its group and removes its directory
            return
        spare.check_warm()

    async def _start_one(self) -> Spare:
        """A spare forked from the fork server (warm at once), or spawned where there is none."""
        directory = private_directory()
        if self.forks is not None and self.forks.serves(self.command_prefix, self.env):
            forked = await self.forks.fork_spare(directory / READY_FILE)
            if forked is not None:
                return Spare(forked, directory)
        return self._spawn(directory)

    def _spawn(self, directory: Path) -> Spare:
        command = [sys.executable, "-m", "modelhost.residency.workers.spare_process"]
        command += ["--module", self.module, "--ready", str(directory / READY_FILE)]
        command += ["--nice", str(0 if self.urgent else WARM_UP_NICE)]
        process = subprocess.Popen(
            command,
            start_new_session=True,
            stdin=subprocess.PIPE,
            env={**os.environ, **self.env},
        )
        return Spare(process, directory)
