"""The supervisor and a spare that dies as it is handed its worker's arguments: the load does not
fail, a new process starts instead."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from modelhost.residency.workers.supervisor import WorkerProcess

# A stand-in worker: answers 200 to anything on the Unix socket it is given (`--socket PATH`).
HEALTHY = """
import http.server, socketserver, sys
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("content-length", "0"); self.end_headers()
    def log_message(self, *args):
        pass
class Server(socketserver.UnixStreamServer):
    def get_request(self):
        request, _ = super().get_request()
        return request, ("", 0)
Server(sys.argv[-1], Handler).serve_forever()
"""


class DyingSpares:
    """Hands over a process that exits before reading anything."""

    def __init__(self) -> None:
        self.handed: list[int] = []
        self.lost_pids: list[int] = []

    def lost(self, process: subprocess.Popen[bytes]) -> None:
        self.lost_pids.append(process.pid)

    async def hand_over(self, command: list[str]) -> tuple[subprocess.Popen[bytes], Path]:
        directory = Path(tempfile.mkdtemp(prefix="modelhost-worker-"))
        os.chmod(directory, 0o700)
        process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"],
                                   start_new_session=True)  # fmt: skip
        self.handed.append(process.pid)
        return process, directory


async def test_a_spare_that_dies_as_it_is_handed_a_model_is_replaced_by_a_new_process():
    spares = DyingSpares()
    worker = WorkerProcess([sys.executable, "-c", HEALTHY], start_timeout_s=60, spares=spares)  # type: ignore[arg-type]
    try:
        await worker.start()
        assert worker.state == "ready" and worker.alive()
        assert worker.from_spare is False
        assert worker.pid not in spares.handed
        assert spares.lost_pids == spares.handed  # the dead spare is reported to its pool
    finally:
        await worker.stop()
    assert not worker.alive()
