"""Residency over several nodes (`residency/cluster.py`), without Ray: each node a residency host
over fake units of known sizes, the cluster host choosing among them."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
from fake_units import FakeUnit, World, settle

from modelhost.residency import cluster as cluster_module
from modelhost.residency.cluster import (
    ClusterHost,
    ClusterRegistry,
    Node,
    affinity_key,
    choose_replica,
)
from modelhost.residency.unit import ResidencyError


def node(name: str, world: World, budget_gb: float, models: list[str]) -> Node[Any]:
    entries = {m: world.entry(m) for m in models}
    return Node(name, name, world.host(budget_gb), entries)  # type: ignore[arg-type]


def placed(cluster: ClusterHost[FakeUnit]) -> dict[str, list[str]]:
    """model -> the nodes holding it."""
    where: dict[str, list[str]] = {}
    for model in cluster.resident():
        where.setdefault(model.id, []).append(str(model.node))
    return {model_id: sorted(nodes) for model_id, nodes in where.items()}


async def lease(cluster: ClusterHost[FakeUnit], model_id: str) -> None:
    async with await cluster.acquire(model_id):
        pass


@pytest.fixture
def two_nodes() -> tuple[ClusterHost[FakeUnit], World, World]:
    sizes = {"a": 4.0, "b": 4.0, "c": 4.0, "big": 20.0}
    small, large = World(dict(sizes)), World(dict(sizes))
    cluster: ClusterHost[FakeUnit] = ClusterHost(rng=random.Random(0))
    cluster.add_node(node("small", small, 10, ["a", "b", "c"]))
    cluster.add_node(node("large", large, 12, ["a", "b", "c", "big"]))
    return cluster, small, large


async def test_a_model_loads_on_the_node_with_the_most_free_budget_that_has_it(two_nodes):
    cluster, _, _ = two_nodes
    await lease(cluster, "a")
    assert placed(cluster) == {"a": ["large"]}  # 12 GB free against 10
    await lease(cluster, "b")
    assert placed(cluster) == {"a": ["large"], "b": ["small"]}  # now 8 against 10


async def test_a_model_only_one_node_has_loads_there_whatever_the_others_have_free(two_nodes):
    cluster, small, _ = two_nodes
    await lease(cluster, "big")  # alone on its node, bigger than the budget: served
    assert placed(cluster) == {"big": ["large"]}
    assert small.loaded() == []


async def test_a_load_on_a_node_that_died_unnoticed_is_placed_again_on_another(two_nodes):
    cluster, _, large = two_nodes
    large.unreachable = True  # Ray says it is not alive; membership has not seen it go yet
    await lease(cluster, "a")  # large has the most free budget, and cannot start the worker
    assert placed(cluster) == {"a": ["small"]}
    await lease(cluster, "b")  # placed on last while not heard from, whatever its free budget
    assert placed(cluster) == {"a": ["small"], "b": ["small"]}


async def test_a_load_no_node_can_reach_fails_once_every_node_was_tried(two_nodes):
    cluster, small, large = two_nodes
    small.unreachable = large.unreachable = True
    with pytest.raises(ResidencyError) as failed:
        await cluster.acquire("a")
    assert failed.value.code == "load-failed"
    assert "not alive" in failed.value.message


async def test_a_model_on_no_node_is_refused_as_not_local(two_nodes):
    cluster, _, _ = two_nodes
    with pytest.raises(ResidencyError) as refused:
        await cluster.acquire("missing")
    assert refused.value.code == "does-not-fit"
    assert "not on any node" in refused.value.message


async def test_eviction_on_one_node_leaves_the_other_nodes_models_alone(two_nodes):
    cluster, small, large = two_nodes
    for model_id in ("a", "b", "c"):  # large, small, then large again (8 free against 6)
        await lease(cluster, model_id)
    assert placed(cluster) == {"a": ["large"], "b": ["small"], "c": ["large"]}
    await lease(cluster, "big")  # only on large: its LRU idle models go, small keeps b
    assert placed(cluster) == {"b": ["small"], "big": ["large"]}
    assert "drain b" not in small.log


async def test_concurrent_first_requests_for_a_model_load_it_once():
    sizes = {"a": 4.0}
    worlds = [World(dict(sizes)), World(dict(sizes))]
    for world in worlds:
        world.gates["a"] = asyncio.Event()
    cluster: ClusterHost[FakeUnit] = ClusterHost()
    cluster.add_node(node("one", worlds[0], 10, ["a"]))
    cluster.add_node(node("two", worlds[1], 10, ["a"]))
    waiters = [asyncio.create_task(lease(cluster, "a")) for _ in range(3)]
    await settle()
    for world in worlds:
        world.gates["a"].set()
    await asyncio.gather(*waiters)
    assert sum(world.num_loads for world in worlds) == 1


def test_without_a_conversation_the_shorter_of_two_random_queues_is_chosen():
    queues = {"n1": 5, "n2": 0}
    assert {choose_replica(queues, None, random.Random(seed)) for seed in range(20)} == {"n2"}


def test_a_conversation_keeps_its_replica_until_its_queue_is_longer_by_more_than_the_slack():
    key = affinity_key(b'{"model": "a", "messages": [{"role": "user", "content": "hello"}]}')
    assert key is not None
    idle = {"n1": 0, "n2": 0, "n3": 0}
    home = choose_replica(idle, key, random.Random(1))
    assert {choose_replica(idle, key, random.Random(seed)) for seed in range(20)} == {home}
    busy = {**idle, home: cluster_module.AFFINITY_SLACK + 1}
    assert home not in {choose_replica(busy, key, random.Random(seed)) for seed in range(20)}


def test_the_second_turn_of_a_conversation_has_the_first_turns_affinity_key():
    first = b'{"model": "a", "messages": [{"role": "user", "content": "hi"}]}'
    second = (
        b'{"model": "a", "messages": [{"role": "user", "content": "hi"}, '
        b'{"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]}'
    )
    other = b'{"model": "a", "messages": [{"role": "user", "content": "bye"}]}'
    assert affinity_key(first) == affinity_key(second) != affinity_key(other)
    assert affinity_key(b"not json") is None


async def test_requests_for_a_replicated_model_are_spread_over_its_replicas(two_nodes):
    cluster, _, _ = two_nodes
    cluster.replicas = {"a": 2}
    await lease(cluster, "a")
    await cluster.maintain()
    assert placed(cluster) == {"a": ["large", "small"]}
    leases = [await cluster.acquire("a") for _ in range(4)]
    busy = {m.node: m.leases for m in cluster.resident()}
    assert busy == {"large": 2, "small": 2}
    for held in leases:
        held.release()


async def test_the_turns_of_one_conversation_lease_the_same_replica(two_nodes):
    cluster, _, _ = two_nodes
    cluster.replicas = {"a": 2}
    await lease(cluster, "a")
    await cluster.maintain()
    assert placed(cluster) == {"a": ["large", "small"]}
    # This conversation's prefix hashes to "small"; with no body, equal queues go to "large".
    turn = b'{"model": "a", "messages": [{"role": "user", "content": "bonjour"}]}'
    nodes = set()
    for _ in range(6):  # one at a time: neither replica is ever busier than the other
        held = await cluster.acquire("a", body=turn)
        nodes.update(m.node for m in cluster.resident() if m.leases)
        held.release()
    assert nodes == {"small"}


async def test_maintain_adds_a_replica_only_where_it_fits_without_evicting(two_nodes):
    cluster, small, _ = two_nodes
    await lease(cluster, "b")  # large
    await lease(cluster, "c")  # small
    await lease(cluster, "a")  # large (8 free against 6)
    cluster.replicas = {"b": 2}  # small holds c and has 6 free: b fits beside it
    await cluster.maintain()
    assert placed(cluster)["b"] == ["large", "small"]
    cluster.replicas = {"a": 2}  # small has 2 free now: a would evict, so it waits
    await cluster.maintain()
    assert placed(cluster)["a"] == ["large"]
    assert "drain c" not in small.log


async def test_a_long_queue_gets_another_replica_which_goes_again_once_idle(two_nodes, monkeypatch):
    cluster, _, _ = two_nodes
    await lease(cluster, "a")
    held = [await cluster.acquire("a") for _ in range(cluster_module.SCALE_UP_QUEUE)]
    for _ in range(cluster_module.SCALE_UP_TICKS):
        await cluster.maintain()
    assert placed(cluster) == {"a": ["large", "small"]}
    for lease_ in held:
        lease_.release()
    await cluster.maintain()
    assert placed(cluster) == {"a": ["large", "small"]}  # not idle long enough yet
    monkeypatch.setattr(cluster_module, "SCALE_DOWN_IDLE_S", 0.0)
    await cluster.maintain()
    await settle()
    assert placed(cluster) == {"a": ["large"]}


async def test_a_node_that_leaves_takes_its_models_and_the_next_request_places_them_again(
    two_nodes,
):
    cluster, small, _ = two_nodes
    await lease(cluster, "a")
    assert placed(cluster) == {"a": ["large"]}
    cluster.remove_node("large", "stopped answering")
    assert placed(cluster) == {}
    registry = ClusterRegistry(cluster.live_nodes)
    assert registry.get("big") is None and registry.get("a") is not None
    await lease(cluster, "a")
    assert placed(cluster) == {"a": ["small"]}
    assert cluster.budget_bytes == small.host(10).budget_bytes
    await cluster.close()


async def test_maintain_adds_no_replica_beside_a_model_that_is_still_loading(two_nodes):
    cluster, small, _ = two_nodes
    await lease(cluster, "a")  # large
    small.gates["c"] = asyncio.Event()
    loading = asyncio.create_task(lease(cluster, "c"))  # small: 10 GB free against 8
    await settle()
    cluster.replicas = {"a": 2}
    await cluster.maintain()
    assert placed(cluster)["a"] == ["large"]
    small.gates["c"].set()
    await loading
    await cluster.maintain()
    assert placed(cluster)["a"] == ["large", "small"]  # 4 + 4 of 10 GB: room once it is known
