"""A cluster's worker actor that dies is replaced on its node under a local worker's rule: at most
3 restarts in 60 s, process and actor deaths counted together; past that the unit is broken and
the host evicts it, as a local worker out of restarts. The membership loop looks at every
worker's actor each round, so an idle one that died is replaced (or its model evicted) without a
request. Stand-in actors answer the front's calls here (no Ray cluster); `test_cluster_serving`
kills a real actor."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from modelhost.residency.cluster import ClusterHost
from modelhost.residency.cluster import Node as ClusterNode
from modelhost.residency.host import ResidencyHost
from modelhost.residency.registry import ServingShape
from modelhost.residency.workers.supervisor import MAX_RESTARTS, WorkerProcess

ray = pytest.importorskip("ray")

from modelhost.cluster.membership import Membership  # noqa: E402
from modelhost.cluster.remote_unit import NodeGone, RemoteWorker, RemoteWorkerUnit  # noqa: E402

PORTS = itertools.count(9000)


@pytest.fixture(autouse=True)
def killed(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The actors `ray.kill` was asked to end: a real one would start a local Ray cluster."""
    ended: list[Any] = []
    monkeypatch.setattr(ray, "kill", ended.append)
    return ended


class Call:
    """`actor.method.remote(...)`: an awaitable that fails as Ray's does once the actor died."""

    def __init__(self, actor: StandInActor, answer: Callable[..., Any]) -> None:
        self.actor, self.answer = actor, answer

    def remote(self, *args: Any) -> Any:
        async def run() -> Any:
            if self.actor.dead:
                raise ray.exceptions.ActorDiedError()
            return self.answer(*args)

        return run()


class StandInActor:
    def __init__(self, restart_ages: list[float]) -> None:
        self.dead = False
        self.where = {"host": "10.0.0.2", "port": next(PORTS), "pid": 1, "restarts": 0}
        self.where["restart_ages"] = restart_ages  # its worker's window, seeded as given
        self.ensure_alive = Call(self, lambda: self.where)
        self.wait_dead = Call(self, lambda timeout_s: True)
        self.rss_bytes = Call(self, lambda: 1)
        self.exhausted = Call(self, lambda: False)
        self.stop = Call(self, lambda: None)


class Node:
    """Spawns stand-in actors for one model, as `Membership._spawn` does on a node."""

    def __init__(self) -> None:
        self.given_ages: list[list[float]] = []
        self.left = False
        self.gate: asyncio.Event | None = None  # set: a spawn waits for it (a load's time)

    async def spawn(self, restart_ages: list[float]) -> tuple[StandInActor, dict[str, Any]]:
        if self.left:
            raise NodeGone("the node left")
        self.given_ages.append(restart_ages)
        if self.gate is not None:
            await self.gate.wait()
        actor = StandInActor(restart_ages)
        return actor, actor.where


def resident(node: Node, restart_ages: list[float] | None = None) -> RemoteWorkerUnit:
    actor = StandInActor(restart_ages or [])
    return RemoteWorkerUnit("tiny", 1, RemoteWorker(actor, actor.where, node.spawn), "node-b")


async def test_an_actor_that_dies_is_replaced_on_its_node_three_times_a_minute_then_given_up():
    node = Node()
    unit = resident(node)
    for restart in range(1, MAX_RESTARTS + 1):
        port = unit.remote.address[1]
        unit.remote.actor.dead = True
        assert await unit.remote.wait_dead(2.0)  # a request could not connect
        assert await unit.remote.ensure_alive()  # a new actor, its worker on a new port
        assert unit.remote.address[1] != port and unit.remote.restarts == restart
        assert len(node.given_ages[-1]) == restart  # its rule carries on the count
        assert not unit.broken()
    unit.remote.actor.dead = True
    await unit.refresh()  # the host's reading learns the actor died
    assert unit.broken()  # out of restarts: the host evicts it on its next lease
    assert not await unit.remote.ensure_alive()  # the proxy's 502, as on one machine
    assert len(node.given_ages) == MAX_RESTARTS


async def test_restarts_of_the_worker_process_count_against_its_actors_restarts():
    node = Node()
    unit = resident(node, restart_ages=[5.0, 10.0])  # its process died twice this minute
    for replaced in (True, False):
        unit.remote.actor.dead = True
        assert await unit.remote.wait_dead(2.0)
        assert await unit.remote.ensure_alive() is replaced
    assert unit.broken() and len(node.given_ages) == 1


async def test_restarts_older_than_the_window_are_forgotten():
    node = Node()
    unit = resident(node, restart_ages=[61.0, 62.0, 63.0])
    unit.remote.actor.dead = True
    assert await unit.remote.ensure_alive()
    assert node.given_ages == [[pytest.approx(0.0, abs=1.0)]]


async def test_an_actor_whose_node_left_is_gone_and_not_replaced():
    node = Node()
    unit = resident(node)
    node.left = True
    unit.remote.actor.dead = True
    assert not await unit.remote.ensure_alive()
    assert unit.remote.gone and unit.broken() and node.given_ages == []


def test_a_worker_started_with_earlier_restarts_counts_them():
    worker = WorkerProcess(["true"], restart_ages=[1.0] * MAX_RESTARTS)
    assert worker.exhausted()  # never started, and no restart left this minute
    assert worker.restarts == 0  # those belong to its predecessors
    assert not WorkerProcess(["true"], restart_ages=[61.0] * MAX_RESTARTS).exhausted()


@dataclass(frozen=True)
class Entry:
    id: str = "tiny"
    estimate_bytes: int = 1
    weights_bytes: int = 1
    operations: tuple[str, ...] = ("generate",)


async def never_loads(entry: Any, progress: Any) -> RemoteWorkerUnit:
    raise AssertionError("the loop never loads a model")


def watched(node: Node) -> tuple[Membership, ResidencyHost[RemoteWorkerUnit], RemoteWorkerUnit]:
    """A membership loop over one node where `tiny` is resident (an idle stand-in actor)."""
    host: ResidencyHost[RemoteWorkerUnit] = ResidencyHost(
        budget_bytes=10**9, source={"tiny": Entry()}.get, load=never_loads
    )
    unit = resident(node)
    host.adopt(Entry(), unit)
    cluster: ClusterHost[RemoteWorkerUnit] = ClusterHost()
    cluster.add_node(ClusterNode("n1", "node-b", host, {"tiny": Entry()}))  # type: ignore[dict-item]
    membership = Membership(
        cluster,
        secret="s",
        worker_arguments=lambda entry: [],
        shape=ServingShape(),
        paths=[],
        node_budget_bytes=None,
        hold_s=0.0,
    )
    return membership, host, unit


async def one_round(membership: Membership) -> None:
    """The loop's look at every worker, to its end (a replacement included)."""
    await asyncio.gather(*membership.watch_workers())


async def until_released(host: ResidencyHost[RemoteWorkerUnit]) -> None:
    async with asyncio.timeout(5):
        while host.resident():
            await asyncio.sleep(0.01)


async def test_the_loop_replaces_an_idle_actor_that_died_without_waiting_for_a_request():
    node = Node()
    membership, host, unit = watched(node)
    await one_round(membership)
    assert node.given_ages == []  # alive: looked at, left alone
    port = unit.remote.address[1]
    unit.remote.actor.dead = True
    await one_round(membership)
    assert len(node.given_ages) == 1 and unit.remote.restarts == 1
    assert unit.remote.alive() and unit.remote.address[1] != port
    assert [model.id for model in host.resident()] == ["tiny"]


async def test_the_loop_evicts_a_model_whose_actor_died_past_the_restart_rule():
    node = Node()
    membership, host, unit = watched(node)
    for _ in range(MAX_RESTARTS):
        unit.remote.actor.dead = True
        await one_round(membership)
    assert unit.remote.restarts == MAX_RESTARTS and host.resident()
    unit.remote.actor.dead = True
    await one_round(membership)
    await until_released(host)  # it leaves the listing; the next request loads it afresh
    assert len(node.given_ages) == MAX_RESTARTS


async def test_one_look_at_a_time_per_worker_while_its_replacement_loads():
    node = Node()
    node.gate = asyncio.Event()
    membership, _, unit = watched(node)
    unit.remote.actor.dead = True
    looking = membership.watch_workers()
    while not node.given_ages:
        await asyncio.sleep(0.01)
    assert membership.watch_workers() == []  # the next rounds wait for this look
    node.gate.set()
    await asyncio.gather(*looking)
    assert len(node.given_ages) == 1 and unit.remote.alive()


async def test_an_actor_that_starts_after_its_model_was_evicted_is_stopped(killed):
    node = Node()
    node.gate = asyncio.Event()
    unit = resident(node)
    unit.remote.actor.dead = True
    replacing = asyncio.create_task(unit.remote.ensure_alive())
    while not node.given_ages:
        await asyncio.sleep(0.01)
    await unit.close()  # evicted while its new actor loads
    node.gate.set()
    assert not await replacing
    assert len(killed) == 2  # the dead actor, then the new one nobody owns
    assert killed[-1] is not killed[0]
