"""A resident model on another node, as the front's residency and proxy see it: a `WorkerUnit`
whose worker is a `ModelWorker` actor's process, reached over TCP with the cluster secret.

The proxy (`server/front/worker_proxy`) is the one a single machine uses: the same requests, relayed
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
from collections.abc import Awaitable, Callable
from typing import Any, cast

import httpx
import ray

from modelhost.residency.workers.supervisor import RestartWindow
from modelhost.residency.workers.worker_unit import WorkerUnit
from modelhost.server.edge.cluster_secret import SECRET_HEADER

log = logging.getLogger("modelhost.cluster")

CALL_TIMEOUT_S = 5.0
FRESH_S = 1.0  # an actor's "alive" this recent spares the next request a Ray call

# A new actor on the same node for a model whose actor died: given the restart ages to carry on
# (RestartWindow.ages), it returns the actor and its `where()`; NodeGone when the node is not
# there to take it.
Spawn = Callable[[list[float]], Awaitable[tuple[Any, dict[str, Any]]]]


class ActorDied(ConnectionError):
    """The actor's process is gone (Ray says so), as opposed to a call that went unanswered."""


class NodeGone(ConnectionError):
    """The node an actor was pinned to is no longer in the cluster."""


async def call(ref: Any, timeout_s: float = CALL_TIMEOUT_S) -> Any:
    """An actor call's result; a dead actor raises ActorDied, a silent one ConnectionError."""
    try:
        return await asyncio.wait_for(ref, timeout_s)
    except ray.exceptions.ActorDiedError as exc:
        raise ActorDied(f"{type(exc).__name__}: {exc}") from None
    except (TimeoutError, ray.exceptions.RayError) as exc:
        raise ConnectionError(f"{type(exc).__name__}: {exc}") from None


class RemoteWorker:
    """What the proxy and the views ask of a worker (`WorkerProcess`'s surface), through its
    actor.

    A worker process that dies is respawned by its actor (`WorkerProcess`'s rule). An actor
    that dies (its worker exits with it) is replaced, on demand as a dead local worker is, by a
    new actor on the same node (`spawn`), under that same rule and count: the actor reports the
    ages of the restarts its rule counts, and the new actor's worker starts with them; at most
    `MAX_RESTARTS` in `RESTART_WINDOW_S`, process and actor deaths together. Past that, or
    without `spawn`, the worker is out of restarts: `ensure_alive` says no (the proxy's 502
    `engine_unavailable`, as on one machine) and the host evicts the unit on its next lease."""

    def __init__(self, actor: Any, where: dict[str, Any], spawn: Spawn | None = None) -> None:
        self.actor = actor
        self.spawn = spawn
        self.gone = False  # its node left the cluster, or its actor stopped answering
        self.closed = False  # its unit closed: a new actor started now would have no owner
        self.actor_died = False  # known dead; replaced on the next `ensure_alive` when allowed
        self.state = "ready"
        self.directory = "remote"  # /engine lists `socket_path` when there is a directory
        self._alive_at = -FRESH_S
        self._earlier_restarts = 0  # restarts counted under the model's earlier actors
        self._lock = asyncio.Lock()
        self._update(where)

    def _update(self, where: dict[str, Any]) -> None:
        self.address: tuple[str, int] = (str(where["host"]), int(where["port"]))
        self.pid: int | None = where.get("pid")
        self.restarts: int = self._earlier_restarts + int(where.get("restarts", 0))
        self.state = str(where.get("state", "ready"))
        self._ages = RestartWindow(ages=where.get("restart_ages", ()))

    @property
    def socket_path(self) -> str:
        host, port = self.address
        return f"tcp://{host}:{port}"

    def alive(self) -> bool:
        return not self.gone and not self.actor_died

    def out_of_restarts(self) -> bool:
        """Dead, and the rule allows no new actor now (a local worker's `exhausted`)."""
        return self.actor_died and (self.spawn is None or not self._ages.allows())

    async def ensure_alive(self) -> bool:
        """Whether the worker serves (respawned by its actor when it died, or by a new actor
        when the actor died). Asked before every proxied request: within `FRESH_S` of an answer
        it is taken as alive without a Ray call, and a request that then fails to connect asks
        again (`wait_dead` forgets the answer)."""
        if self.gone:
            return False
        if self._fresh():
            return True
        async with self._lock:  # one caller replaces a dead actor; the others wait for it
            if self.gone:
                return False
            if self._fresh():
                return True
            if not self.actor_died:
                try:
                    where = await call(self.actor.ensure_alive.remote(), 130.0)
                except ActorDied as exc:
                    log.warning("[cluster] worker actor at %s died: %s", self.socket_path, exc)
                    self.actor_died = True
                except ConnectionError as exc:
                    log.warning("[cluster] worker at %s does not answer: %s", self.socket_path, exc)
                    self.gone = True
                    return False
                else:
                    if where is None:
                        return False
                    self._update(where)
                    self._alive_at = time.monotonic()
                    return True
            return await self._replace()

    def _fresh(self) -> bool:
        return not self.actor_died and time.monotonic() - self._alive_at < FRESH_S

    async def _replace(self) -> bool:
        """A new actor on the node for a dead one, when the restart rule allows; the try counts
        whether or not it starts (as a local respawn's does)."""
        if self.closed or self.spawn is None or not self._ages.allows():
            return False
        self._ages.record()
        self._earlier_restarts = self.restarts = self.restarts + 1
        self.state = "starting"
        try:
            actor, where = await self.spawn(self._ages.ages())
        except NodeGone:
            self.gone = True
            return False
        except Exception as exc:  # the load failed: the next request may try again
            log.warning("[cluster] a new worker actor did not start: %s", exc)
            self.state = "failed"
            return False
        if self.closed:  # evicted while the new actor started: it is nobody's
            with contextlib.suppress(Exception):
                ray.kill(actor)
            return False
        self.actor, self.actor_died = actor, False
        self._update(where)
        self._alive_at = time.monotonic()
        return True

    async def wait_dead(self, timeout_s: float) -> bool:
        self._alive_at = -FRESH_S
        if self.gone or self.actor_died:
            return True
        try:
            return bool(await call(self.actor.wait_dead.remote(timeout_s), timeout_s + 2))
        except ActorDied:
            self.actor_died = True
            return True
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

    def measured_bytes(self) -> int | None:
        return None if self._closed else self._measured

    async def give_back_idle_memory(self) -> None:
        if self.remote.gone or self.remote.actor_died:
            return
        with contextlib.suppress(ActorDied, ConnectionError):
            await call(self.remote.actor.give_back_idle_memory.remote(), 15.0)

    async def refresh(self) -> None:
        if self.remote.gone:
            return
        if self.remote.actor_died:
            return
        try:
            rss = await call(self.remote.actor.rss_bytes.remote())
            if rss is not None:
                self._measured = max(int(rss), self.weights_bytes)
            self._exhausted = bool(await call(self.remote.actor.exhausted.remote()))
        except ActorDied:
            self.remote.actor_died = True  # replaced on demand, or evicted when out of restarts
        except ConnectionError:
            pass

    def broken(self) -> bool:
        return self.remote.gone or self._exhausted or self.remote.out_of_restarts()

    def interrupt(self) -> None:
        self._ending = True
        if self.remote.alive():
            self.remote.actor.interrupt.remote()

    async def close(self) -> bool:
        if not self._closed:
            self._closed = self._ending = True
            self.remote.closed = True
            await self._http.aclose()
            if self.remote.alive():
                with contextlib.suppress(ConnectionError):
                    await call(self.remote.actor.stop.remote(), 15.0)
            with contextlib.suppress(Exception):
                ray.kill(self.remote.actor)
        return True

    def client(self) -> httpx.AsyncClient:
        """An HTTP client on the worker's TCP address (a new one after it was respawned)."""
        return self._http.on(self.remote.address, {SECRET_HEADER: self.secret})
