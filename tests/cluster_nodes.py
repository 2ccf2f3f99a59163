"""A Ray cluster simulated on this machine for tests and benchmarks: a head and other nodes, each
a `ray start --block` in its own process group with its own MODELHOST_HOME (the models given
copied into it) and its own `modelhost_budget_mb`; and `modelhost serve --cluster` as its front.

Stopped by process group, never with `ray stop` (which ends every Ray process on the machine).
A Ray worker process starts its own session, but exits once its node's raylet is gone.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
from live_server import free_port

RAY = str(Path(sys.executable).with_name("ray"))
SRC = str(Path(__file__).resolve().parents[1] / "src")
START_TIMEOUT_S = 90.0
# Small and quiet: two cores are shared by every node, the front and the tests.
NODE_FLAGS = [
    "--block", "--num-cpus", "1", "--object-store-memory", "100000000",
    "--disable-usage-stats",
]  # fmt: skip


def node_env(home: Path) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": SRC, "MODELHOST_HOME": str(home)}
    env.update(HF_HUB_CACHE=str(home / "hub"), RAY_USAGE_STATS_ENABLED="0")
    # Ray turns token authentication on for a head when ~/.ray/auth_token exists (any local
    # `ray.init()` leaves one) but not for the nodes that join it: one mode for all, set here.
    env.update(RAY_AUTH_MODE="disabled")
    env.update(RAY_health_check_period_ms="1000", RAY_health_check_failure_threshold="3")
    return env


class RayNodes:
    """Node i has `budgets_mb[i]` and the model folders `models[i]` in its home's models/."""

    def __init__(self, root: Path, budgets_mb: Sequence[int], models: Sequence[Sequence[Path]]):
        self.root = root
        self.budgets_mb = list(budgets_mb)
        self.models = [list(m) for m in models]
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.processes: list[subprocess.Popen[bytes]] = []
        self.homes: list[Path] = []
        # Ray's sockets live under its temp dir and a socket's path may not pass 107 bytes: a
        # short folder of /tmp, not the test's (pytest-xdist's tmp paths are longer).
        self.ray_dir = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))

    def start(self) -> RayNodes:
        try:
            for index in range(len(self.budgets_mb)):
                self._start_node(index)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_node(self, index: int) -> None:
        home = self.root / f"node{index}"
        (home / "models").mkdir(parents=True, exist_ok=True)
        for folder in self.models[index]:
            shutil.copytree(folder, home / "models" / folder.name, dirs_exist_ok=True)
        self.homes.append(home)
        resources = f'{{"modelhost_budget_mb": {self.budgets_mb[index]}}}'
        if index == 0:
            where = ["--head", "--port", str(self.port), "--include-dashboard", "false"]
            where += ["--temp-dir", str(self.ray_dir)]
        else:
            where = ["--address", self.address]
        log_path = self.root / f"node{index}.log"
        command = [RAY, "start", *where, *NODE_FLAGS, "--resources", resources]
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                command,
                env=node_env(home),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=home,
            )
        self.processes.append(process)
        deadline = time.monotonic() + START_TIMEOUT_S
        while b"Ray runtime started" not in log_path.read_bytes():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray node {index} did not start: {log_path.read_text()}")
            time.sleep(0.2)

    def kill(self, index: int) -> None:
        """The node's whole process group, at once (a machine that goes away)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.processes[index].pid, signal.SIGKILL)

    def stop(self) -> None:
        """Workers first (their raylet ends them), then the head, each by its process group."""
        for process in reversed(self.processes):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
        for process in self.processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        shutil.rmtree(self.ray_dir, ignore_errors=True)


class ClusterFront:
    """`modelhost serve --cluster` in its own process group, on a free port."""

    def __init__(
        self,
        nodes: RayNodes,
        arguments: Sequence[str],
        home: Path,
        engine_flags: Sequence[str] = ("--batch", "2", "--prompt-threads", "1"),
    ) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = nodes.root / "front.log"
        flags = ["--port", str(self.port), *engine_flags]
        command = [sys.executable, "-m", "modelhost", "serve", "--cluster", nodes.address]
        env = {**node_env(home), "RAY_ADDRESS": ""}
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [*command, *flags, *arguments],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait_ready(self, timeout_s: float = 420.0) -> ClusterFront:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the front exited: {self.log_path.read_text()}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.base_url}/health", timeout=1).status_code == 200:
                    return self
            time.sleep(0.3)
        raise RuntimeError(f"the front did not start: {self.log_path.read_text()}")

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
