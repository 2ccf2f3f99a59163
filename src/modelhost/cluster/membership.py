"""Who is in the cluster, from Ray: nodes join and leave the front's `ClusterHost`.

Every `PERIOD_S` the loop reads the cluster's live nodes (the GCS's view) and pings each node's
agent. A node that is new gets an agent (what models it holds, its budget) and a residency host
of its own; a node the GCS calls dead, or whose agent misses `MISSED_PINGS` pings in a row, leaves
at once: its units are marked gone (a request on them fails fast as 502 `engine_unavailable`,
a stream as its protocol's error frame), its models leave every view, and the next request for
them places them on a node that is still here. The GCS's own verdict takes its health checks
(15 s by default); the pings make it a few seconds.

Each round also looks at every resident model's worker actor (`_watch`, beside the loop, one look
per worker at a time): an actor Ray reports dead is replaced on its node as the next request
would replace it (the 3-a-minute rule, `RemoteWorker`), and a worker out of restarts is evicted,
its model leaving `/v1/models` then, not when a request finds it.

A node's budget is, first, the `modelhost_budget_mb` resource its `ray start --resources` gave
it; else `--node-budget`; else 70% of its RAM (or GPU memory), as a single machine's default.

Model workers are named detached actors (`<node id>|<model id>` in the `modelhost` namespace), so
a front that restarts finds the models resident on each node and adopts them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from modelhost.cluster.actors import ModelWorker, NodeAgent
from modelhost.cluster.remote_unit import NodeGone, RemoteWorker, RemoteWorkerUnit, call
from modelhost.residency.cluster import ClusterHost, Node
from modelhost.residency.host import ResidencyHost
from modelhost.residency.registry import ModelEntry, ServingShape
from modelhost.residency.unit import LoadProgress, ResidencyError

log = logging.getLogger("modelhost.cluster")

NAMESPACE = "modelhost"
BUDGET_RESOURCE = "modelhost_budget_mb"
SECRET_KEY = b"modelhost/cluster-secret"
PERIOD_S = 1.0
MISSED_PINGS = 2
PING_TIMEOUT_S = 2.0
RESCAN_S = 10.0  # how often each node's models and free memory are read again
JOIN_TIMEOUT_S = 120.0


def pinned_to(node_id: str) -> NodeAffinitySchedulingStrategy:
    return NodeAffinitySchedulingStrategy(node_id, soft=False)


def worker_name(node_id: str, model_id: str) -> str:
    """Unique: a model evicted and loaded again must not wait for its old name to be free."""
    return f"{node_id}|{model_id}|{secrets.token_hex(4)}"


class Membership:
    def __init__(
        self,
        cluster: ClusterHost[RemoteWorkerUnit],
        *,
        secret: str,
        worker_arguments: Callable[[ModelEntry], list[str]],
        shape: ServingShape,
        paths: list[str],
        node_budget_bytes: int | None,
        hold_s: float,
        start_timeout_s: float = 120.0,
    ) -> None:
        self.cluster = cluster
        self.secret = secret
        self.worker_arguments = worker_arguments
        self.shape = shape
        self.paths = paths
        self.node_budget_bytes = node_budget_bytes
        self.hold_s = hold_s
        self.start_timeout_s = start_timeout_s
        self._agents: dict[str, Any] = {}
        self._available: dict[str, int | None] = {}
        self._missed: dict[str, int] = {}
        self._joining: dict[str, asyncio.Task[None]] = {}
        self._scanned_at = 0.0
        self._maintaining: asyncio.Task[None] | None = None
        self._watching: dict[RemoteWorkerUnit, asyncio.Task[None]] = {}

    async def run(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception:  # the loop outlives one bad reading
                log.exception("[cluster] membership check failed")
            await asyncio.sleep(PERIOD_S)

    async def tick(self) -> None:
        alive = {n["NodeID"]: n for n in await asyncio.to_thread(ray.nodes) if n.get("Alive")}
        for node_id in list(self.cluster.nodes):
            if node_id not in alive:
                self.leave(node_id, "left the cluster")
        for node_id, info in alive.items():
            if node_id not in self.cluster.nodes and node_id not in self._joining:
                task = asyncio.create_task(self.join(node_id, info))
                self._joining[node_id] = task
                task.add_done_callback(functools.partial(self._joined, node_id))
        await asyncio.gather(*(self._ping(n) for n in list(self.cluster.nodes)))
        if time.monotonic() - self._scanned_at > RESCAN_S:
            self._scanned_at = time.monotonic()
            await asyncio.gather(*(self._rescan(n) for n in list(self.cluster.nodes)))
        self.watch_workers()
        # Beside the loop, one pass at a time: a replica's load must not hold back the pings.
        if self._maintaining is None or self._maintaining.done():
            self._maintaining = self.cluster.run_beside(self.cluster.maintain())

    def agents(self) -> dict[str, Any]:
        """Each member node's agent, by node id."""
        return dict(self._agents)

    def _joined(self, node_id: str, task: asyncio.Task[None]) -> None:
        self._joining.pop(node_id, None)

    async def wait_for_nodes(self, timeout_s: float = JOIN_TIMEOUT_S) -> None:
        """The first reading, and every node it found joined (or failed to)."""
        await self.tick()
        if self._joining:
            await asyncio.wait(list(self._joining.values()), timeout=timeout_s)

    # -- joining and leaving -------------------------------------------------------------------

    async def join(self, node_id: str, info: dict[str, Any]) -> None:
        agent = NodeAgent.options(  # type: ignore[attr-defined]
            scheduling_strategy=pinned_to(node_id)
        ).remote(asdict(self.shape), self.paths)
        try:
            described = await call(agent.describe.remote(), JOIN_TIMEOUT_S)
            entries = await call(agent.models.remote(), JOIN_TIMEOUT_S)
        except ConnectionError as exc:
            log.warning("[cluster] node %s cannot serve models: %s", node_id[:8], exc)
            ray.kill(agent)
            return
        name = f"{described['address']}/{node_id[:8]}"
        advertised = info.get("Resources", {}).get(BUDGET_RESOURCE)
        if advertised:
            budget = int(advertised * 1_000_000)
        else:
            budget = self.node_budget_bytes or int(described["default_budget_bytes"])
        self._agents[node_id] = agent
        self._available[node_id] = described["available_bytes"]
        models = {entry.id: entry for entry in entries}
        host: ResidencyHost[RemoteWorkerUnit] = ResidencyHost(
            budget_bytes=budget,
            source=functools.partial(self._entry, node_id),
            load=self._loader(node_id, name),
            hold_s=self.hold_s,
            available=functools.partial(self._available.get, node_id),
        )
        await self._adopt_resident(node_id, name, host, models)
        log.info(
            "[cluster] node %s joined: %.2f GB budget, %d models (home %s)",
            name, budget / 1e9, len(models), described["home"] or "~/.modelhost",
        )  # fmt: skip
        self.cluster.add_node(Node(node_id, name, host, models, home=described["home"]))

    def _entry(self, node_id: str, model_id: str) -> ModelEntry | None:
        node = self.cluster.nodes.get(node_id)
        return node.models.get(model_id) if node is not None else None

    def leave(self, node_id: str, reason: str) -> None:
        node = self.cluster.nodes.get(node_id)
        if node is None:
            return
        for model in node.host.resident():
            unit = node.host.peek(model.id)
            if unit is not None:
                unit.remote.gone = True
                watch = self._watching.get(unit)
                if watch is not None:  # a new actor there would never start
                    watch.cancel()
        agent = self._agents.pop(node_id, None)
        if agent is not None:
            with contextlib.suppress(Exception):
                ray.kill(agent)
        self._missed.pop(node_id, None)
        self.cluster.remove_node(node_id, reason)

    async def _ping(self, node_id: str) -> None:
        agent = self._agents.get(node_id)
        if agent is None:
            return
        try:
            await call(agent.ping.remote(), PING_TIMEOUT_S)
            self._missed[node_id] = 0
        except ConnectionError:
            self._missed[node_id] = self._missed.get(node_id, 0) + 1
            if self._missed[node_id] >= MISSED_PINGS:
                self.leave(node_id, "stopped answering")

    async def _rescan(self, node_id: str) -> None:
        agent = self._agents.get(node_id)
        if agent is None:
            return
        with contextlib.suppress(ConnectionError):
            entries = await call(agent.models.remote(), 30.0)
            self.cluster.update_models(node_id, {entry.id: entry for entry in entries})
            self._available[node_id] = await call(agent.available_bytes.remote())

    # -- model workers ---------------------------------------------------------------------

    def watch_workers(self) -> list[asyncio.Task[None]]:
        """A look at each ready worker whose last look has ended (a replacement may take a
        load's time; the other workers are looked at meanwhile): the looks begun."""
        begun = []
        for node in self.cluster.live_nodes():
            for model in node.host.resident():
                unit = node.host.peek(model.id)
                if unit is None or unit in self._watching:
                    continue
                task = self.cluster.run_beside(self._watch(node, unit))
                self._watching[unit] = task
                task.add_done_callback(functools.partial(self._watched, unit))
                begun.append(task)
        return begun

    def _watched(self, unit: RemoteWorkerUnit, task: asyncio.Task[None]) -> None:
        self._watching.pop(unit, None)

    async def _watch(self, node: Node[RemoteWorkerUnit], unit: RemoteWorkerUnit) -> None:
        await unit.refresh()  # Ray's ActorDiedError marks a dead actor
        resident = node.host.peek(unit.model_id) is unit  # not evicted meanwhile
        if unit.remote.actor_died and resident and not node.gone and not self._missed.get(node.id):
            # Its node answers: the actor alone died. Replaced as a request would replace it.
            log.warning("[cluster] %s: its worker actor on %s died", unit.model_id, node.name)
            if await unit.remote.ensure_alive():
                log.info("[cluster] %s: a new worker actor on %s", unit.model_id, node.name)
        if unit.broken():
            node.host.evict_broken()

    def _loader(self, node_id: str, name: str) -> Callable[..., Any]:
        async def load(entry: ModelEntry, progress: LoadProgress) -> RemoteWorkerUnit:
            started = time.perf_counter()
            actor, where = await self._spawn(node_id, entry, [])
            unit = self._unit(node_id, entry, actor, where, name)
            unit.load_ms = (time.perf_counter() - started) * 1000
            await unit.read_card()
            return unit

        return load

    async def _spawn(
        self, node_id: str, entry: ModelEntry, restart_ages: list[float]
    ) -> tuple[Any, dict[str, Any]]:
        """A `ModelWorker` actor on the node, its worker started (its restart rule given the
        model's earlier restarts, when this replaces an actor that died): the actor and where
        its worker listens. NodeGone when the node has left."""
        if node_id not in self.cluster.nodes:
            raise NodeGone(f"node {node_id[:8]} has left the cluster")
        alive = await asyncio.to_thread(ray.nodes)
        if not any(n["NodeID"] == node_id and n.get("Alive") for n in alive):
            raise NodeGone(f"node {node_id[:8]} is not alive")  # the loop will see it leave
        actor = ModelWorker.options(  # type: ignore[attr-defined]
            name=worker_name(node_id, entry.id),
            namespace=NAMESPACE,
            lifetime="detached",
            scheduling_strategy=pinned_to(node_id),
        ).remote()
        arguments = self.worker_arguments(entry)
        try:
            ref = actor.start.remote(arguments, self.secret, {}, self.start_timeout_s, restart_ages)
            where = await call(ref, self.start_timeout_s + JOIN_TIMEOUT_S)
        except BaseException:
            with contextlib.suppress(Exception):
                ray.kill(actor)
            raise
        return actor, where

    def _unit(
        self, node_id: str, entry: ModelEntry, actor: Any, where: dict[str, Any], name: str
    ) -> RemoteWorkerUnit:
        spawn = functools.partial(self._spawn, node_id, entry)
        worker = RemoteWorker(actor, where, spawn)
        unit = RemoteWorkerUnit(entry.id, entry.weights_bytes, worker, name)
        unit.secret = self.secret
        return unit

    async def _adopt_resident(
        self,
        node_id: str,
        name: str,
        host: ResidencyHost[RemoteWorkerUnit],
        models: dict[str, ModelEntry],
    ) -> None:
        """The workers a previous front left on this node, adopted as resident."""
        names = await asyncio.to_thread(ray.util.list_named_actors, True)
        for listed in names:
            if not isinstance(listed, dict) or listed.get("namespace") != NAMESPACE:
                continue
            node_part, _, rest = str(listed.get("name", "")).partition("|")
            model_id = rest.rpartition("|")[0]
            entry = models.get(model_id)
            if node_part != node_id or entry is None:
                continue
            try:
                actor = ray.get_actor(listed["name"], namespace=NAMESPACE)
                where = await call(actor.ensure_alive.remote(), 30.0)
            except (ValueError, ConnectionError):
                continue
            if where is None:
                with contextlib.suppress(Exception):
                    ray.kill(actor)
                continue
            unit = self._unit(node_id, entry, actor, where, name)
            await unit.read_card()
            try:
                host.adopt(entry, unit)
            except ResidencyError:  # a second copy on one node: one is enough
                await unit.close()
                continue
            log.info("[cluster] %s: found resident on %s", model_id, name)


def cluster_secret(token: str | None) -> str:
    """`token` (from --cluster-token-file), else the cluster's own, made by its first front."""
    from ray.experimental import internal_kv

    if token is not None:
        return token
    internal_kv._internal_kv_put(SECRET_KEY, secrets.token_hex(32), overwrite=False)
    return internal_kv._internal_kv_get(SECRET_KEY).decode()
