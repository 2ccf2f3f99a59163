"""The fork server: one warm process that forks every worker and spare, so that a new worker
costs a fork instead of starting Python and importing PyTorch (2.5-3 CPU-seconds).

    python -m modelhost.residency.workers.fork_server --module MODULE --socket PATH [--ready F]

`modelhost serve` starts it at once, beside its own start (forks.py, the front's side). It binds
PATH (0600, in a 0700 directory) first, then imports MODULE and runs its `warm_up()` (PyTorch,
the native kernels, the tokenizer machinery; nothing of any model), creates F, then forks on
request, one connection a child. A request is one JSON line:

- `{"argv": [...]}`: a worker, `MODULE.main(argv)` in the child;
- `{"spare": READY}`: a spare, with the read end of a pipe passed beside the line: it creates
  READY at once and waits on that pipe for its worker's arguments (spare_process.become_worker);
- `{"keep": MODEL}`: `MODULE.keep(MODEL)` here, for the children forked after it (the worker's
  module parses the model's tokenizer: models/loading/tokenizer_files.py), answered
  `{"kept": FILES}`, what it keeps now (null: nothing for MODEL).

The answer is `{"pid": N}` with a pidfd of the child passed beside it (SCM_RIGHTS): the front
learns of the child's end from the kernel, never through a pid that could be reused. When the
child ends, this process reaps it and writes `{"exit": STATUS}` on its connection.

Forking is safe only from a process with no other threads holding locks: this one runs one
thread. Nothing here runs a tensor operation, so PyTorch's OpenMP pool is never started (the
child sets its thread count as a worker does); OpenBLAS's pool (numpy's) stops itself around a
fork. The child then starts a session of its own (its own process group and autogroup, as a
spawned worker has), puts back the default signal handlers, closes this server's sockets and
draws new random seeds. A forked worker watches the serving process, not this one
(`serving_process_gone`): a fork server that dies leaves its workers serving. This process
ends when the serving process does (its parent changes) or on SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import os
import random
import select
import shutil
import signal
import socket
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from modelhost.residency.workers.private_socket import bind_private_socket
from modelhost.residency.workers.spare_process import become_worker

REQUEST_BYTES = 1 << 20  # a worker's arguments (its config as JSON) fit many times over
REQUEST_TIMEOUT_S = 10.0  # the front sends its line at once after connecting
PARENT_CHECK_S = 1.0

# In a forked child: the serving process (the fork server's parent), which the child's work
# ends with. None in any other process: its parent is the serving process.
_serving_pid: int | None = None


def serving_process_gone() -> Callable[[], bool]:
    """A check, True once the process this one serves has ended: its parent, or for a process
    forked by the fork server, the fork server's parent (watched through a pidfd)."""
    if _serving_pid is None:
        parent = os.getppid()
        return lambda: os.getppid() != parent
    try:
        pidfd = os.pidfd_open(_serving_pid)
    except OSError:  # already gone
        return lambda: True
    return lambda: bool(select.select([pidfd], [], [], 0)[0])


def read_message(conn: socket.socket) -> tuple[dict[str, object], list[int]]:
    """One JSON line and the descriptors passed with it."""
    data, descriptors = b"", []
    while not data.endswith(b"\n"):
        chunk, fds, _flags, _address = socket.recv_fds(conn, REQUEST_BYTES, 4)
        descriptors += fds
        if not chunk:
            break
        data += chunk
    message = json.loads(data) if data.strip() else {}
    if not isinstance(message, dict):
        raise ValueError("a request is a JSON object")
    return message, descriptors


class ForkServer:
    def __init__(self, module: ModuleType, listener: socket.socket) -> None:
        self.module = module
        self.listener = listener
        self.parent = os.getppid()
        self.children: dict[int, socket.socket] = {}  # pid -> the connection it was asked on
        self.wake_read, self.wake_write = socket.socketpair()

    def run(self) -> None:
        for end in (self.wake_read, self.wake_write):
            end.setblocking(False)
        signal.set_wakeup_fd(self.wake_write.fileno())
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wake-up fd hears it
        while os.getppid() == self.parent:
            ready, _, _ = select.select([self.listener, self.wake_read], [], [], PARENT_CHECK_S)
            if self.wake_read in ready:
                with contextlib.suppress(BlockingIOError):
                    self.wake_read.recv(4096)
            self.reap()
            if self.listener in ready:
                conn, _ = self.listener.accept()
                self.answer(conn)

    def answer(self, conn: socket.socket) -> None:
        conn.settimeout(REQUEST_TIMEOUT_S)
        descriptors: list[int] = []
        try:
            request, descriptors = read_message(conn)
            if "keep" in request:
                self.keep(conn, request["keep"])
                return
            pid = os.fork()
            if pid == 0:
                self.child(conn, request, descriptors)  # never returns
            pidfd = os.pidfd_open(pid)  # before this process reaps it: the pid is still its
            try:
                socket.send_fds(conn, [json.dumps({"pid": pid}).encode() + b"\n"], [pidfd])
            finally:
                os.close(pidfd)
            self.children[pid] = conn
        except (OSError, ValueError) as exc:
            print(f"modelhost-fork-server: a request failed: {exc!r}", file=sys.stderr)
            conn.close()
        finally:
            for fd in descriptors:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def keep(self, conn: socket.socket, model: object) -> None:
        """`MODULE.keep(model)`, answered and the connection closed. Whatever it raises is
        printed, never fatal: the children then only parse what was not kept."""
        kept = None
        keeper = getattr(self.module, "keep", None)
        if isinstance(model, str) and keeper is not None:
            try:
                kept = keeper(model)
            except Exception:  # noqa: BLE001
                traceback.print_exc()
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps({"kept": kept}).encode() + b"\n")
        conn.close()

    def reap(self) -> None:
        """Reap every child that ended and tell its connection how."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(OSError):
                    exit_line = {"exit": os.waitstatus_to_exitcode(status)}
                    conn.sendall(json.dumps(exit_line).encode() + b"\n")
                conn.close()

    def child(self, conn: socket.socket, request: dict[str, object], fds: list[int]) -> None:
        """The forked process: a clean start, then the worker or the spare; never returns."""
        global _serving_pid
        code: object = 1
        try:
            os.setsid()  # its own process group (the front stops the group) and autogroup
            signal.set_wakeup_fd(-1)
            for number in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):
                signal.signal(number, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            for sock in (self.listener, self.wake_read, self.wake_write, conn):
                sock.close()
            for other in self.children.values():
                other.close()
            _serving_pid = self.parent
            random.seed()
            numpy = sys.modules.get("numpy")
            if numpy is not None:
                numpy.random.seed()
            stdin = fds[0] if fds else os.open(os.devnull, os.O_RDONLY)
            os.dup2(stdin, 0)
            for fd in {stdin, *fds}:
                os.close(fd)
            ready = request.get("spare")
            if isinstance(ready, str):
                Path(ready).touch()  # warm already
                code = become_worker(self.module, Path(ready), lambda: None)
            else:
                argv = request.get("argv")
                assert isinstance(argv, list) and all(isinstance(a, str) for a in argv)
                code = self.module.main(argv)
        except SystemExit as exc:
            code = exc.code
        except BaseException:
            traceback.print_exc()
            code = 1
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code if isinstance(code, int) else 0 if code is None else 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="modelhost-fork-server")
    parser.add_argument("--module", required=True, help="the worker's module (its main, warm_up)")
    parser.add_argument("--socket", required=True, help="where to listen (in a 0700 directory)")
    parser.add_argument("--ready", default=None, help="a file created once warm")
    args = parser.parse_args(argv)
    listener = bind_private_socket(args.socket)  # first: the front may connect at once
    module = importlib.import_module(args.module)
    warm_up = getattr(module, "warm_up", None)
    if warm_up is not None:
        warm_up()
    # What the children share with this process stays shared: the collector no longer writes
    # to every object's header (its generation links) in a child, copying the page it is on.
    gc.freeze()
    if args.ready:
        Path(args.ready).touch()
    ForkServer(module, listener).run()
    # The serving process is gone (a clean one stops this process first): nobody else removes
    # the directory it made for this socket.
    shutil.rmtree(Path(args.socket).parent, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
