"""The two Ray actors a cluster runs on each node, pinned there (hard node affinity, no CPUs).

- `NodeAgent`, one per node: what the node holds (its registry, as `modelhost ls` sees it there:
  `MODELHOST_HOME/models`, the Hugging Face cache, the embedded models), its memory, its address.
- `ModelWorker`, one per resident model: it spawns and owns today's worker process on its node
  (`modelhost.cli.worker`, the same `WorkerProcess` a single machine uses, with its 3-per-minute
  restart rule), which listens on its private Unix socket and on the node's cluster address
  (`--listen`), guarded by the cluster secret. Tokens go from that worker to the front as
  HTTP/SSE over TCP; Ray carries only control calls (start, health, measure, stop). An actor
  that dies takes its worker with it (the worker exits with its parent); the front puts a new
  one on the same node under the same rule and count (`remote_unit.RemoteWorker`).

Both read their node's environment: the `ray start` that made the node chose MODELHOST_HOME,
and `node_env()` hands it to every worker the node starts explicitly, with the node's folder for
request series (`node_series`): what a worker keeps on disk (the GGUF and native caches, the
prefix KV store in `MODELHOST_HOME/kv`) is its node's, never the front's or another node's, even
when simulated nodes share one machine.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import ray

from modelhost.cluster.node_series import NodeSamples, plain_samples, samples_directory
from modelhost.paths import modelhost_home
from modelhost.residency.registry import ModelEntry, ModelRegistry, ServingShape
from modelhost.residency.workers.supervisor import WorkerFailed, WorkerProcess
from modelhost.server.edge.cluster_secret import SECRET_ENV
from modelhost.server.observability.prometheus import read_samples


def node_address() -> str:
    return str(ray.util.get_node_ip_address())


def node_home() -> str:
    """This node's MODELHOST_HOME, absolute: as its `ray start` chose it, else ~/.modelhost of
    the user who ran it (a Ray worker process inherits the raylet's environment)."""
    return str(modelhost_home().expanduser().resolve())


def node_samples_directory() -> Path:
    """This node's folder for its workers' request series, made if new."""
    context = ray.get_runtime_context()
    node_id = context.get_node_id()
    directory = samples_directory(context.get_temp_dir(), context.get_session_name(), node_id)
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def node_env() -> dict[str, str]:
    """What every worker on this node is started with: the node's home and its series folder."""
    return {
        "MODELHOST_HOME": node_home(),
        "PROMETHEUS_MULTIPROC_DIR": str(node_samples_directory()),
    }


@ray.remote(num_cpus=0, max_restarts=0)
class NodeAgent:
    def __init__(self, shape: dict[str, Any], paths: list[str]) -> None:
        self.registry = ModelRegistry(paths, shape=ServingShape(**shape))
        self.samples = str(node_samples_directory())

    def describe(self) -> dict[str, Any]:
        from modelhost.serve_config import available_memory_bytes, default_budget_bytes

        return {
            "address": node_address(),
            "default_budget_bytes": default_budget_bytes(),
            "available_bytes": available_memory_bytes(),
            "home": node_home(),
        }

    def request_series(self) -> NodeSamples:
        """The request series of every worker this node ran, summed (`node_series`)."""
        return plain_samples(read_samples(self.samples))

    def models(self) -> list[ModelEntry]:
        return self.registry.entries()

    def available_bytes(self) -> int | None:
        from modelhost.serve_config import available_memory_bytes

        return available_memory_bytes()

    def ping(self) -> bool:
        return True


@ray.remote(num_cpus=0, max_restarts=0)
class ModelWorker:
    """One model's worker process on this node (an async actor: its calls share one loop)."""

    def __init__(self) -> None:
        self.worker: WorkerProcess | None = None
        self.address = node_address()
        # Ray gives its own worker processes OMP_NUM_THREADS=1 (no num_cpus asked); the model's
        # worker is not one of them: it sizes its threads as on a single machine (--threads).
        os.environ.pop("OMP_NUM_THREADS", None)

    async def start(
        self,
        arguments: list[str],
        secret: str,
        env: dict[str, str],
        start_timeout_s: float,
        restart_ages: list[float] | None = None,
    ) -> dict[str, Any]:
        """Spawn the worker (`WORKER_COMMAND` `arguments`) and wait until it answers.
        `restart_ages`: the model's restarts before this actor (its previous actor died), still
        counted."""
        from modelhost.serve_config import WORKER_COMMAND

        command = [*WORKER_COMMAND, *arguments]
        self.worker = WorkerProcess(
            [*command, "--listen", self.address],
            env={**env, **node_env(), SECRET_ENV: secret},
            start_timeout_s=start_timeout_s,
            restart_ages=restart_ages or (),
        )
        try:
            await self.worker.start()
        except WorkerFailed as exc:
            await self.worker.stop()
            raise RuntimeError(str(exc)) from None
        return self.where()

    def where(self) -> dict[str, Any]:
        """The worker's TCP address, process and restarts (the port changes on a restart), and
        the ages of the restarts its rule still counts (handed on if this actor dies)."""
        from modelhost.serve_config import TCP_PORT_FILE

        assert self.worker is not None
        port_file = Path(self.worker.socket_path).with_name(TCP_PORT_FILE)
        return {
            "host": self.address,
            "port": int(port_file.read_text()),
            "pid": self.worker.pid,
            "restarts": self.worker.restarts,
            "restart_ages": self.worker.restart_window.ages(),
            "state": self.worker.state,
        }

    async def ensure_alive(self) -> dict[str, Any] | None:
        """Respawn a dead worker when its restarts allow; its address, or None."""
        if self.worker is None or not await self.worker.ensure_alive():
            return None
        return self.where()

    async def wait_dead(self, timeout_s: float) -> bool:
        return self.worker is None or await self.worker.wait_dead(timeout_s)

    def rss_bytes(self) -> int | None:
        return self.worker.memory_bytes() if self.worker is not None else None

    def exhausted(self) -> bool:
        return self.worker is None or self.worker.exhausted()

    async def interrupt(self) -> None:
        """End the worker's requests now (the front's forced shutdown)."""
        import httpx

        if self.worker is None or not self.worker.alive():
            return
        try:
            await self._post_to_worker("/admin/drain", {"timeout_ms": 0, "force": True}, 2.0)
        except httpx.HTTPError:
            self.worker.kill_now()

    async def give_back_idle_memory(self) -> None:
        """Have the idle worker's engine give back its KV pool now (the front's host asks
        before it evicts a model for room)."""
        import httpx

        if self.worker is None or not self.worker.alive():
            return
        with contextlib.suppress(httpx.HTTPError):
            await self._post_to_worker("/admin/give-back", None, 10.0)

    async def _post_to_worker(self, path: str, body: Any, timeout_s: float) -> None:
        """A POST on the worker's private socket; httpx.HTTPError unless it answers 2xx."""
        import httpx

        assert self.worker is not None
        transport = httpx.AsyncHTTPTransport(uds=self.worker.socket_path)
        async with httpx.AsyncClient(transport=transport, base_url="http://w") as client:
            (await client.post(path, json=body, timeout=timeout_s)).raise_for_status()

    async def stop(self) -> None:
        if self.worker is not None:
            await self.worker.stop()
