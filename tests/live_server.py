"""A real modelhost server for tests: uvicorn with modelhost's shutdown rules, on a free loopback
port, in a background thread of the test process."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time

from starlette.applications import Starlette

from modelhost.server.http_server import server_for

START_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def open_tcp_fds(pid: int | str = "self") -> int:
    """The open TCP sockets (IPv4 and IPv6) of process `pid`, this one by default."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as rows:
            inodes.update(row.split()[9] for row in list(rows)[1:])
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            count += link.startswith("socket:[") and link[8:-1] in inodes
    return count


class LiveServer:
    """`app` on 127.0.0.1 from `start()` (or `with`) until `stop()`."""

    def __init__(self, app: Starlette, *, shutdown_timeout_s: float = 5.0) -> None:
        self.app = app
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.server = server_for(
            app,
            host="127.0.0.1",
            port=self.port,
            shutdown_timeout_s=shutdown_timeout_s,
            log_level="warning",
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def __enter__(self) -> LiveServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
