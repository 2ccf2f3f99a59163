"""Residency over several machines: one `ResidencyHost` per node, and where each model goes.

Each node keeps the local rules unchanged (budget, least recently used idle victims, leases,
pins, the hold window, a model alone always served): it is a `ResidencyHost` over that node's
budget and that node's models. This module only decides *which* node's host a request leases
from, and keeps the node set current:

- a model resident (or loading) on some nodes is leased from one of its replicas: the one that
  holds the conversation's prefix (rendezvous hashing of the request's affinity key), unless its
  queue is longer than a random other one's by more than `AFFINITY_SLACK`; without a key, the
  shorter queue of two random replicas (the "power of two choices");
- a model resident nowhere loads on a node that has the file, the one with the most free budget
  (whose host then evicts its own least recently used idle models if it must);
- `maintain()` keeps `replicas` copies on distinct nodes, adds one where there is room while a
  model's queue stays long, and drops an added one again once it has been idle a while. A
  replica only goes to a node where nothing is loading or leaving and where, by current
  readings, it fits without evicting anything: a replica never makes a request's model leave.

Nothing here knows Ray: nodes join and leave through `add_node`/`remove_node` (the cluster
package's membership loop calls them), and a node's host loads through whatever `load` its
caller gave it. A request's body comes with its `acquire`; its affinity key (`affinity_key`)
is computed only when a model has several replicas to choose from.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from modelhost.residency.host import ResidencyHost
from modelhost.residency.lease import Lease
from modelhost.residency.registry import ModelEntry
from modelhost.residency.unit import ResidencyError, ResidentModel, Unit

log = logging.getLogger("modelhost.cluster")

U = TypeVar("U", bound=Unit)

AFFINITY_SLACK = 1  # requests more in flight on the prefix's replica before another is chosen
SCALE_UP_QUEUE = 4  # requests in flight per replica that count as a long queue
SCALE_UP_TICKS = 3  # consecutive maintain() ticks with a long queue before a replica is added
SCALE_DOWN_IDLE_S = 60.0  # an added replica idle this long is dropped again
UNREACHABLE_S = 30.0  # a node a load could not reach is placed on last this long


def affinity_key(body: bytes) -> str | None:
    """What stays the same across the turns of one conversation: the body's first messages
    (system and first user turn) or the first 256 characters of its prompt or input."""
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(value, dict):
        return None
    head: Any = None
    if isinstance(value.get("messages"), list):
        head = [value.get("system"), value["messages"][:1]]
    elif isinstance(value.get("prompt"), str):
        head = value["prompt"][:256]
    elif isinstance(value.get("input"), str):
        head = value["input"][:256]
    elif isinstance(value.get("input"), list):
        head = value["input"][:1]
    if head is None:
        return None
    text = json.dumps([value.get("model"), head], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def choose_replica(
    queues: dict[str, int], key: str | None, rng: random.Random | None = None
) -> str:
    """The node (of `queues`: node -> requests in flight there) a request goes to."""
    nodes = sorted(queues)
    rng = rng or random.Random()
    if len(nodes) == 1:
        return nodes[0]
    pair = rng.sample(nodes, 2)
    shorter = min(pair, key=lambda node: (queues[node], node))
    if key is None:
        return shorter
    affine = max(nodes, key=lambda node: hashlib.sha256(f"{key}:{node}".encode()).digest())
    return affine if queues[affine] <= queues[shorter] + AFFINITY_SLACK else shorter


@dataclass(slots=True, eq=False)
class Node(Generic[U]):
    """A member: its id, the name views show, its residency host and the models on its disk."""

    id: str
    name: str
    host: ResidencyHost[U]
    models: dict[str, ModelEntry]
    gone: bool = False
    added_replicas: dict[str, float] = field(default_factory=dict)  # model -> added at
    home: str | None = None  # its MODELHOST_HOME, where its workers keep what they keep on disk


class ClusterRegistry:
    """Every node's models as one registry: an id is local when some live node has it."""

    def __init__(self, nodes: Callable[[], Sequence[Node[Any]]]) -> None:
        self._nodes = nodes

    def get(self, model_id: str) -> ModelEntry | None:
        for node in self._nodes():
            entry = node.models.get(model_id)
            if entry is not None:
                return entry
        return None

    def entries(self) -> list[ModelEntry]:
        seen: dict[str, ModelEntry] = {}
        for node in self._nodes():
            for model_id, entry in node.models.items():
                seen.setdefault(model_id, entry)
        return list(seen.values())

    def resolve_argument(self, name: str) -> ModelEntry | None:
        return self.get(name)

    def nodes_with(self, model_id: str) -> list[str]:
        return [node.name for node in self._nodes() if model_id in node.models]


class ClusterHost(Generic[U]):
    """The `ResidencyHost` surface the router and the server use, over every node's host."""

    def __init__(
        self, *, replicas: dict[str, int] | None = None, rng: random.Random | None = None
    ) -> None:
        self.nodes: dict[str, Node[U]] = {}
        self.replicas = dict(replicas or {})
        self.hold_s = 0.0
        self._rng = rng or random.Random()
        self._placing: dict[str, Node[U]] = {}
        # Nodes a load could not reach (their worker's start said the node is not alive)
        # before membership saw them leave, when: placed on last for UNREACHABLE_S.
        self._unreachable: dict[str, float] = {}
        self._long_queue_ticks: dict[str, int] = {}
        self._listeners: list[Callable[[str, dict[str, Any]], None]] = []
        self._changed = asyncio.Event()
        self._closed = False
        self._closing: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    # -- membership ------------------------------------------------------------------------

    def add_node(self, node: Node[U]) -> None:
        if self._closed:
            self._spawn(node.host.close())
            return
        for listener in self._listeners:
            node.host.subscribe(listener)
        self.nodes[node.id] = node
        self._publish("node.join", {"node": node.name, "budget_bytes": node.host.budget_bytes})
        self._wake()

    def remove_node(self, node_id: str, reason: str = "left") -> None:
        """Forget a node at once (its models leave every view); its units close in the
        background, and a request for its models places them on a node that is still here."""
        node = self.nodes.pop(node_id, None)
        if node is None:
            return
        node.gone = True
        for model_id, placing in list(self._placing.items()):
            if placing is node:
                del self._placing[model_id]
        log.warning("[cluster] node %s %s; its models will load elsewhere", node.name, reason)
        self._publish("node.leave", {"node": node.name, "reason": reason})
        self._spawn(node.host.close())
        self._wake()

    def update_models(self, node_id: str, models: dict[str, ModelEntry]) -> None:
        node = self.nodes.get(node_id)
        if node is not None:
            node.models = models

    def live_nodes(self) -> list[Node[U]]:
        return [node for node in self.nodes.values() if not node.gone]

    @property
    def budget_bytes(self) -> int:
        return sum(node.host.budget_bytes for node in self.live_nodes())

    # -- leasing ---------------------------------------------------------------------------

    async def acquire(
        self, model_id: str, *, need: str | None = None, body: bytes | None = None
    ) -> Lease[U]:
        """A lease from the node that holds (or will hold) `model_id`; among several replicas,
        the one `body`'s conversation went to before, unless it is much busier."""
        tries = 0
        while True:
            self._refuse_if_closed()
            node = self._node_for(model_id, body)
            try:
                return await node.host.acquire(model_id, need=need)
            except ResidencyError as error:
                unreached = error.code == "load-failed" and isinstance(
                    error.__cause__, ConnectionError
                )
                if unreached and not self._closed and tries < len(self.nodes):
                    # A node that died before membership saw it go: place the model again,
                    # on another node while this one is not heard from.
                    self._unreachable[node.id] = time.monotonic()
                    tries += 1
                    continue
                if error.code != "closed" or self._closed or not node.gone:
                    raise
                # The node left while this request waited for it: place it again.
            finally:
                if self._placing.get(model_id) is node:
                    del self._placing[model_id]

    def _node_for(self, model_id: str, body: bytes | None) -> Node[U]:
        """Where a lease on `model_id` comes from now (see the module docstring). A model being
        placed is placed once: requests that come meanwhile wait on the same node."""
        queues = self._queues(model_id)
        if len(queues) == 1:
            return self.nodes[next(iter(queues))]
        if queues:
            key = affinity_key(body) if body is not None else None
            return self.nodes[choose_replica(queues, key, self._rng)]
        placing = self._placing.get(model_id)
        if placing is not None and not placing.gone:
            return placing
        node = self._place(model_id, self.live_nodes())
        self._placing[model_id] = node
        return node

    def _queues(self, model_id: str) -> dict[str, int]:
        """node id -> requests in flight, for each node where `model_id` is loading or ready."""
        queues: dict[str, int] = {}
        for node in self.live_nodes():
            for model in node.host.resident():
                if model.id == model_id and model.state in ("ready", "loading"):
                    queues[node.id] = model.leases
        return queues

    def _place(self, model_id: str, candidates: Sequence[Node[U]]) -> Node[U]:
        """A node that has the model's file: the one with the most free budget, one a load
        could not reach lately last."""
        having = [node for node in candidates if model_id in node.models]
        if not having:
            raise ResidencyError(
                "does-not-fit", f"model '{model_id}' is not on any node of the cluster"
            )
        lately = time.monotonic() - UNREACHABLE_S
        return max(
            having,
            key=lambda node: (
                self._unreachable.get(node.id, -math.inf) < lately,
                self._free_bytes(node),
                node.name,
            ),
        )

    @staticmethod
    def _free_bytes(node: Node[U]) -> int:
        return node.host.budget_bytes - node.host.used_bytes()

    def peek(self, model_id: str) -> U | None:
        """A ready replica of `model_id` (the least busy), without a lease."""
        queues = {
            node.id: model.leases
            for node in self.live_nodes()
            for model in node.host.resident()
            if model.id == model_id and model.state == "ready"
        }
        if not queues:
            return None
        return self.nodes[min(queues, key=lambda n: (queues[n], n))].host.peek(model_id)

    def peek_on(self, model_id: str, node_name: str) -> U | None:
        for node in self.live_nodes():
            if node.name == node_name:
                return node.host.peek(model_id)
        return None

    def run_beside(self, work: Any) -> asyncio.Task[Any]:
        """Run `work` (the membership loop) until the host closes."""
        return self._spawn(work)

    # -- operator actions --------------------------------------------------------------------

    async def unload(self, model_id: str, *, force: bool = False) -> bool | None:
        results = [
            await node.host.unload(model_id, force=force)
            for node in self.live_nodes()
            if any(m.id == model_id for m in node.host.resident())
        ]
        return None if not results else all(bool(r) for r in results)

    def pin(self, model_id: str, pinned: bool = True) -> bool:
        found = [node.host.pin(model_id, pinned) for node in self.live_nodes()]
        return any(found)

    def unpin(self, model_id: str) -> bool:
        return self.pin(model_id, False)

    def keep_alive(self, model_id: str, seconds: float) -> bool:
        found = [node.host.keep_alive(model_id, seconds) for node in self.live_nodes()]
        return any(found)

    async def serve(self, model_id: str) -> None:
        raise ResidencyError("not-switchable", "a cluster routes by the request's model")

    def subscribe(self, listener: Callable[[str, dict[str, Any]], None]) -> None:
        self._listeners.append(listener)
        for node in self.nodes.values():
            node.host.subscribe(listener)

    # -- replicas ----------------------------------------------------------------------------

    async def maintain(self) -> None:
        """One pass: top up `replicas`, add one for a long queue, drop an idle added one.
        A new replica only goes where it fits without evicting anything."""
        if self._closed:
            return
        now = time.time()
        for model_id in {*self.replicas, *self._resident_ids()}:
            holding = [n for n in self.live_nodes() if self._holds(n, model_id)]
            wanted = self.replicas.get(model_id, 0)
            in_flight = sum(self._queues(model_id).values())
            long_queue = bool(holding) and in_flight >= SCALE_UP_QUEUE * len(holding)
            ticks = self._long_queue_ticks.get(model_id, 0) + 1 if long_queue else 0
            self._long_queue_ticks[model_id] = ticks
            if len(holding) < wanted or ticks >= SCALE_UP_TICKS:
                added = await self._add_replica(model_id, holding)
                if added is not None and len(holding) >= wanted:
                    added.added_replicas[model_id] = now
                    self._long_queue_ticks[model_id] = 0
            elif len(holding) > max(wanted, 1):
                await self._drop_idle_added(model_id, holding, now)

    def _resident_ids(self) -> set[str]:
        return {m.id for node in self.live_nodes() for m in node.host.resident()}

    @staticmethod
    def _holds(node: Node[U], model_id: str) -> bool:
        return any(m.id == model_id and m.state != "draining" for m in node.host.resident())

    async def _add_replica(self, model_id: str, holding: list[Node[U]]) -> Node[U] | None:
        others = [n for n in self.live_nodes() if n not in holding and model_id in n.models]
        settled = [n for n in others if all(m.state == "ready" for m in n.host.resident())]
        for node in settled:  # a loading model's bytes are only its estimate until it answers
            await node.host.refresh()
        roomy = [n for n in settled if self._fits_without_eviction(n, model_id)]
        if not roomy:
            return None
        node = self._place(model_id, roomy)
        log.info("[cluster] %s: a replica on %s", model_id, node.name)
        try:
            async with await node.host.acquire(model_id):
                pass
        except ResidencyError as error:
            log.warning("[cluster] %s: no replica on %s: %s", model_id, node.name, error)
            return None
        return node

    @staticmethod
    def _fits_without_eviction(node: Node[U], model_id: str) -> bool:
        with contextlib.suppress(ResidencyError):
            plan = node.host.plan(model_id)
            return plan.fits and not plan.evict
        return False

    async def _drop_idle_added(self, model_id: str, holding: list[Node[U]], now: float) -> None:
        for node in holding:
            added_at = node.added_replicas.get(model_id)
            row = next((m for m in node.host.resident() if m.id == model_id), None)
            if added_at is None or row is None or row.leases or row.pinned:
                continue
            if now - max(added_at, row.last_used_at) >= SCALE_DOWN_IDLE_S:
                node.added_replicas.pop(model_id, None)
                log.info("[cluster] %s: dropping the idle replica on %s", model_id, node.name)
                with contextlib.suppress(ResidencyError):
                    await node.host.unload(model_id)
                return

    # -- views -------------------------------------------------------------------------------

    def resident(self) -> list[ResidentModel]:
        """Every replica of every node, each row naming its node."""
        return [
            dataclasses.replace(model, node=node.name)
            for node in self.live_nodes()
            for model in node.host.resident()
        ]

    def used_bytes(self) -> int:
        return sum(node.host.used_bytes() for node in self.live_nodes())

    def nodes_view(self) -> list[dict[str, Any]]:
        """`/stats.cluster`: each node's budget, use and models."""
        return [
            {
                "node": node.name,
                "home": node.home,
                "budget_bytes": node.host.budget_bytes,
                "used_bytes": node.host.used_bytes(),
                "models": sorted(node.models),
                "resident": [m.id for m in node.host.resident()],
            }
            for node in self.live_nodes()
        ]

    # -- closing ---------------------------------------------------------------------------

    def close(self) -> asyncio.Task[None]:
        if self._closing is None:
            self._closed = True
            self._wake()
            self._closing = asyncio.get_running_loop().create_task(self._close())
        return self._closing

    async def _close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        closes = [node.host.close() for node in self.nodes.values()]
        await asyncio.gather(*closes, return_exceptions=True)

    @property
    def closed(self) -> bool:
        return self._closed

    def _refuse_if_closed(self) -> None:
        if self._closed:
            raise ResidencyError("closed", "the server is closing")

    # -- plumbing --------------------------------------------------------------------------

    def _publish(self, name: str, payload: dict[str, Any]) -> None:
        for listener in self._listeners:
            with contextlib.suppress(Exception):
                listener(name, payload)

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_change(self, timeout_s: float | None = None) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout_s)

    def _spawn(self, work: Any) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task
