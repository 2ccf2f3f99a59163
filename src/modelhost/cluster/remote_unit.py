"""A resident model on another node, as the front's residency and proxy see it: a `WorkerUnit`
whose worker is a `ModelWorker` actor's process, reached over TCP with the cluster secret.

The proxy (`server/worker_proxy`) is the one a single machine uses: the same requests, relayed
streams, 502 `engine_unavailable` and mid-stream error frames. Only the channel differs: a TCP
connection to the node's address (no handing the client's socket over: it is on this machine),
and control calls go to the actor through Ray, each with a timeout, a node that does not answer
counting as a dead worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, cast

import httpx
import ray

from modelhost.residency.worker_transport import WorkerTransport
from modelhost.residency.worker_unit import WorkerUnit
from modelhost.server.cluster_secret import SECRET_HEADER

log = logging.getLogger("modelhost.cluster")

CALL_TIMEOUT_S = 5.0
FRESH_S = 1.0  # an actor's "alive" this recent spares the next request a Ray call


async def call(ref: Any, timeout_s: float = CALL_TIMEOUT_S) -> Any:
    """An actor call's result; a dead or silent actor raises ConnectionError."""
    try:
        return await asyncio.wait_for(ref, timeout_s)
    except (TimeoutError, ray.exceptions.RayError) as exc:
        raise ConnectionError(f"{type(exc).__name__}: {exc}") from None


class RemoteWorker:
    """What the proxy and the views ask of a worker (`WorkerProcess`'s surface), through its
    actor."""

    def __init__(self, actor: Any, where: dict[str, Any]) -> None:
        self.actor = actor
        self.gone = False  # its node left the cluster, or its actor stopped answering
        self.state = "ready"
        self.directory = "remote"  # /engine lists `socket_path` when there is a directory
        self._alive_at = -FRESH_S
        self._update(where)

    def _update(self, where: dict[str, Any]) -> None:
        self.address: tuple[str, int] = (str(where["host"]), int(where["port"]))
        self.pid: int | None = where.get("pid")
        self.restarts: int = int(where.get("restarts", 0))
        self.state = str(where.get("state", "ready"))

    @property
    def socket_path(self) -> str:
        host, port = self.address
        return f"tcp://{host}:{port}"

    def alive(self) -> bool:
        return not self.gone

    async def ensure_alive(self) -> bool:
        """Whether the worker serves (respawned by its actor when it died). Asked before every
        proxied request: within `FRESH_S` of an answer it is taken as alive without a Ray call,
        and a request that then fails to connect asks again (`wait_dead` forgets the answer)."""
        if self.gone:
            return False
        if time.monotonic() - self._alive_at < FRESH_S:
            return True
        try:
            where = await call(self.actor.ensure_alive.remote(), 130.0)
        except ConnectionError as exc:
            log.warning("[cluster] worker at %s does not answer: %s", self.socket_path, exc)
            self.gone = True
            return False
        if where is None:
            return False
        self._update(where)
        self._alive_at = time.monotonic()
        return True

    async def wait_dead(self, timeout_s: float) -> bool:
        self._alive_at = -FRESH_S
        if self.gone:
            return True
        try:
            return bool(await call(self.actor.wait_dead.remote(timeout_s), timeout_s + 2))
        except ConnectionError:
            self.gone = True
            return True


class RemoteWorkerUnit(WorkerUnit):
    hands_off = False

    def __init__(self, model_id: str, weights_bytes: int, worker: RemoteWorker, node: str) -> None:
        super().__init__(model_id, weights_bytes, cast(Any, worker))
        self.remote = worker
        self.node = node
        self.secret = ""
        self._exhausted = False
        self._client_address: tuple[str, int] | None = None

    def measured_bytes(self) -> int | None:
        return None if self._closed else self._measured

    async def refresh(self) -> None:
        if self.remote.gone:
            return
        with contextlib.suppress(ConnectionError):
            rss = await call(self.remote.actor.rss_bytes.remote())
            if rss is not None:
                self._measured = max(int(rss), self.weights_bytes)
            self._exhausted = bool(await call(self.remote.actor.exhausted.remote()))

    def broken(self) -> bool:
        return self.remote.gone or self._exhausted

    def interrupt(self) -> None:
        self._ending = True
        if not self.remote.gone:
            self.remote.actor.interrupt.remote()

    async def close(self) -> bool:
        if not self._closed:
            self._closed = self._ending = True
            if self._client is not None:
                with contextlib.suppress(Exception):
                    await self._client.aclose()
            if not self.remote.gone:
                with contextlib.suppress(ConnectionError):
                    await call(self.remote.actor.stop.remote(), 15.0)
            with contextlib.suppress(Exception):
                ray.kill(self.remote.actor)
        return True

    def client(self) -> httpx.AsyncClient:
        """An HTTP client on the worker's TCP address (a new one after it was respawned)."""
        address = self.remote.address
        if self._client is None or self._client_address != address:
            old, self._client = self._client, None
            if old is not None:
                asyncio.get_running_loop().create_task(old.aclose())
            timeout = httpx.Timeout(connect=10.0, read=None, write=60.0, pool=60.0)
            self._client = httpx.AsyncClient(
                transport=WorkerTransport(address=address),
                base_url="http://worker",
                timeout=timeout,
                headers={SECRET_HEADER: self.secret},
            )
            self._client_address = address
        return self._client
