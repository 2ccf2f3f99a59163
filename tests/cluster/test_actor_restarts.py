"""A cluster's worker actor that dies is replaced on its node under a local worker's rule: at most
3 restarts in 60 s, process and actor deaths counted together; past that the unit is broken and
the host evicts it, as a local worker out of restarts. Stand-in actors answer the front's calls
here (no Ray cluster); `test_cluster_serving` kills a real actor."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest

from modelhost.residency.supervisor import MAX_RESTARTS, WorkerProcess

ray = pytest.importorskip("ray")

from modelhost.cluster.remote_unit import NodeGone, RemoteWorker, RemoteWorkerUnit  # noqa: E402

PORTS = itertools.count(9000)


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


class Node:
    """Spawns stand-in actors for one model, as `Membership._spawn` does on a node."""

    def __init__(self) -> None:
        self.given_ages: list[list[float]] = []
        self.left = False

    async def spawn(self, restart_ages: list[float]) -> tuple[StandInActor, dict[str, Any]]:
        if self.left:
            raise NodeGone("the node left")
        self.given_ages.append(restart_ages)
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
