"""The front's side of the fork server (fork_server.py): start it, ask it for a worker or a spare,
and follow each process it forks as the supervisor follows its own children.

A forked process is not the front's child: `ForkedProcess` offers what the supervisor and the
spare pool use of a `subprocess.Popen` (pid, poll, wait, returncode, stdin), its end told by the
kernel through the pidfd the fork server passed (readable once the process has ended), its exit
status by the fork server, which reaps it. Stopping it is as for a spawned worker: it leads its
own process group. Its memory is counted as its PSS (`pss_bytes`): the pages it still shares
with the fork server (PyTorch, the kernels, the imported modules) are split between them, so
the fork server's PSS beside its workers' counts each page once.

`fork()` and `fork_spare()` answer None where the fork server cannot serve (off Linux, not
started, dead, or asked for another program or environment): the caller spawns a process as
before.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import select
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TypeVar

from modelhost.residency.workers.private_socket import private_directory
from modelhost.residency.workers.supervisor import end_group, pss_bytes

if TYPE_CHECKING:
    from modelhost.residency.host import ResidencyHost

log = logging.getLogger("modelhost.models")

FORK_SERVER_MODULE = "modelhost.residency.workers.fork_server"
SOCKET_NAME = "fork-server.sock"
READY_FILE = "fork-server-ready"  # beside its socket, once warm
WARM_TIMEOUT_S = 120.0  # how long a request waits for a fork server still warming up
EXIT_REPORT_S = 1.0  # how long an ended process's status is waited for from the fork server
UNKNOWN_STATUS = 255  # the status of a process whose fork server did not report it
REPLY_BYTES = 4096

_Reply = TypeVar("_Reply")


def fork_server_supported() -> bool:
    """Linux with pidfds (5.3) and descriptor passing: where the fork server can run."""
    return sys.platform == "linux" and hasattr(os, "pidfd_open") and hasattr(socket, "send_fds")


class ForkedProcess:
    """A process the fork server forked, seen through the pidfd it passed."""

    def __init__(self, pid: int, pidfd: int, connection: socket.socket, rest: bytes) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.stdin: IO[bytes] | None = None  # a spare's: where its worker's arguments go
        self._pidfd = pidfd
        self._connection = connection  # the fork server writes the exit status here
        self._rest = rest  # what was read past the first answer
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        return self._finish(0.0)

    def wait(self, timeout: float | None = None) -> int:
        status = self._finish(timeout)
        if status is None:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        return status

    def _finish(self, timeout: float | None) -> int | None:
        with self._lock:
            if self.returncode is None and select.select([self._pidfd], [], [], timeout)[0]:
                self.returncode = self._exit_status()
                os.close(self._pidfd)
                self._connection.close()
            return self.returncode

    def _exit_status(self) -> int:
        data = self._rest
        self._connection.settimeout(EXIT_REPORT_S)
        with contextlib.suppress(OSError):
            while b"\n" not in data:
                chunk = self._connection.recv(REPLY_BYTES)
                if not chunk:
                    break
                data += chunk
        with contextlib.suppress(ValueError):
            status = json.loads(data.split(b"\n", 1)[0]).get("exit")
            if isinstance(status, int):
                return status
        return UNKNOWN_STATUS  # the fork server is gone: nobody saw the status


class ForkServerHandle:
    """The fork server of one `modelhost serve`: forks workers of `module` run with `env` added
    to this process's environment (the environment a spawned worker would get)."""

    def __init__(
        self, module: str, *, env: Mapping[str, str] | None = None, warm_s: float = WARM_TIMEOUT_S
    ) -> None:
        self.module = module
        self.command_prefix = [sys.executable, "-m", module]
        self.env = dict(env or {})
        self.warm_s = warm_s
        self.process: subprocess.Popen[bytes] | None = None
        self.directory: Path | None = None
        self.forked = 0  # processes it forked for this server
        self.kept: list[str] = []  # the tokenizer files it keeps (its last answer to keep())
        self._keeping: set[asyncio.Task[bool]] = set()  # keep() requests under way
        self.started_at = 0.0

    @property
    def socket_path(self) -> str:
        assert self.directory is not None
        return str(self.directory / SOCKET_NAME)

    def start(self) -> None:
        """Start the fork server (where supported); it warms up while the caller goes on."""
        if not fork_server_supported() or self.process is not None:
            return
        self.directory = private_directory()
        command = [sys.executable, "-m", FORK_SERVER_MODULE, "--module", self.module]
        command += ["--socket", self.socket_path, "--ready", str(self.directory / READY_FILE)]
        self.started_at = time.monotonic()
        self.process = subprocess.Popen(
            command,
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **self.env},
        )

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def serves(self, command: Sequence[str], env: Mapping[str, str] | None) -> bool:
        """Whether a process it forks would be the one `command` with `env` would start."""
        return (
            self.alive()
            and list(command[: len(self.command_prefix)]) == self.command_prefix
            and dict(env or {}) == self.env
        )

    async def fork(
        self, command: Sequence[str], env: Mapping[str, str] | None = None
    ) -> ForkedProcess | None:
        """A forked process running `command` (its module's main with the arguments after
        `python -m module`), or None: spawn it instead."""
        if not self.serves(command, env):
            return None
        arguments = list(command[len(self.command_prefix) :])
        return await self._asked({"argv": arguments}, None)

    async def fork_spare(self, ready: Path) -> ForkedProcess | None:
        """A forked spare (warm at once: it creates `ready`), reading its worker's arguments
        from its `stdin`; None: spawn one instead."""
        if not self.alive():
            return None
        reading, writing = os.pipe()
        try:
            forked = await self._asked({"spare": str(ready)}, reading)
        except BaseException:
            os.close(writing)
            raise
        finally:
            os.close(reading)
        if forked is None:
            os.close(writing)
            return None
        forked.stdin = os.fdopen(writing, "wb", buffering=0)
        return forked

    async def _asked(self, request: dict[str, Any], stdin: int | None) -> ForkedProcess | None:
        """`_ask` on a thread; a caller cancelled meanwhile has the process it asked for
        stopped, never left running unknown."""
        asking = asyncio.ensure_future(asyncio.to_thread(self._ask, request, stdin))
        try:
            return await asyncio.shield(asking)
        except asyncio.CancelledError:
            forked = await asking
            if forked is not None:
                await asyncio.to_thread(end_group, forked)
            raise

    def follow(self, host: ResidencyHost[Any], path_of: Callable[[str], Path | None]) -> None:
        """After each load `host` ends, have the fork server keep what the model's next load
        would parse again (`keep`): a model evicted and then asked for again is back sooner,
        in a worker forked after. `path_of`: a model id's file or directory (None: unknown)."""

        def on_event(name: str, payload: dict[str, Any]) -> None:
            if name != "model.load" or payload.get("phase") != "finished" or not self.alive():
                return
            path = path_of(str(payload.get("id")))
            if path is not None:
                keeping = asyncio.get_running_loop().create_task(self.keep(str(path)))
                self._keeping.add(keeping)
                keeping.add_done_callback(self._keeping.discard)

        host.subscribe(on_event)

    async def keep(self, model: str) -> bool:
        """Have the fork server parse `model`'s tokenizer for the processes it forks from now
        on (the worker module's `keep`); False when it did not."""
        kept = await asyncio.to_thread(self._exchange, {"keep": model}, None, self._kept_reply)
        if kept is not None:
            self.kept = kept
        return kept is not None

    @staticmethod
    def _kept_reply(connection: socket.socket) -> list[str] | None:
        """The files the fork server keeps now, or None where it kept nothing for the model."""
        data = b""
        while b"\n" not in data:
            chunk = connection.recv(REPLY_BYTES)
            if not chunk:
                raise ConnectionError("the fork server closed the connection")
            data += chunk
        connection.close()
        kept = json.loads(data.split(b"\n", 1)[0]).get("kept")
        return [str(path) for path in kept] if isinstance(kept, list) else None

    def _ask(self, request: dict[str, Any], stdin: int | None) -> ForkedProcess | None:
        return self._exchange(request, stdin, self._forked_reply)

    def _exchange(
        self,
        request: dict[str, Any],
        stdin: int | None,
        reply: Callable[[socket.socket], _Reply],
    ) -> _Reply | None:
        """`request` sent to the fork server (with `stdin` passed beside it), and its reply
        read by `reply` (which owns the connection from then on); None where the fork server
        is gone, or did not answer in its warm-up time."""
        deadline = time.monotonic() + self.warm_s
        while not os.path.exists(self.socket_path):  # it binds first thing
            if not self.alive() or time.monotonic() > deadline:
                return None
            time.sleep(0.005)
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            connection.settimeout(max(0.1, deadline - time.monotonic()))  # its warm-up, at most
            connection.connect(self.socket_path)
            line = json.dumps(request).encode() + b"\n"
            socket.send_fds(connection, [line], [stdin] if stdin is not None else [])
            return reply(connection)
        except (OSError, ValueError) as exc:
            if "keep" in request:
                log.warning("[models] the fork server did not keep a tokenizer (%s)", exc)
            else:
                log.warning("[models] the fork server did not fork (%s): starting a new process",
                            exc)  # fmt: skip
            connection.close()
            return None

    def _forked_reply(self, connection: socket.socket) -> ForkedProcess:
        pidfds: list[int] = []
        try:
            data = b""
            while b"\n" not in data:
                chunk, fds, _flags, _address = socket.recv_fds(connection, REPLY_BYTES, 1)
                pidfds += fds
                if not chunk:
                    raise ConnectionError("the fork server closed the connection")
                data += chunk
            first, rest = data.split(b"\n", 1)
            pid = json.loads(first).get("pid")
            if not isinstance(pid, int) or len(pidfds) != 1:
                raise ValueError(f"the fork server answered {first!r}")
        except (OSError, ValueError):
            for fd in pidfds:
                os.close(fd)
            raise
        connection.settimeout(None)
        self.forked += 1
        return ForkedProcess(pid, pidfds[0], connection, rest)

    def held_bytes(self) -> int:
        """The fork server's PSS now (0 when not running): its share of the pages its
        processes still share with it."""
        if not self.alive():
            return 0
        assert self.process is not None
        return pss_bytes(self.process.pid) or 0

    def view(self) -> dict[str, Any]:
        """The fork server for `GET /engine`."""
        warm = self.directory is not None and (self.directory / READY_FILE).exists()
        state = "gone" if not self.alive() else "ready" if warm else "starting"
        pid = self.process.pid if self.process is not None else None
        socket = self.socket_path if self.directory is not None else None
        return {"state": state, "pid": pid, "pss_bytes": self.held_bytes() or None,
                "forked": self.forked, "socket": socket,
                "tokenizers_kept": self.kept}  # fmt: skip

    def close(self) -> None:
        """Stop the fork server and remove its directory (blocking). Its workers are the
        supervisor's to stop; any it still runs end with the serving process."""
        process, self.process = self.process, None
        if process is not None:
            end_group(process)
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
