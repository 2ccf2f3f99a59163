"""Before the residency host evicts a model for room, the idle models give back what they keep
only for their next request (an engine's KV pool held after its last row), least recently used
first: a model leaves only when that is not enough (fake units, GB = 10⁹ bytes)."""

from __future__ import annotations

from fake_units import GB, World


async def used_then_keeping(world: World, host, model_id: str, kept_gb: float) -> None:  # type: ignore[no-untyped-def]
    """Serve one request on `model_id`, after which it holds `kept_gb` more than its weights."""
    async with await host.acquire(model_id):
        pass
    unit = world.units[model_id]
    unit.measured = int(world.sizes_gb[model_id] * GB + kept_gb * GB)
    unit.kept_bytes = int(kept_gb * GB)


async def c_loaded_beside_a_and_b_keeping_kv():  # type: ignore[no-untyped-def]
    """a and b (1 GB each) served, each keeping 0.8 GB of KV; then c (1 GB) under 4 GB: the
    world, the host and who was resident (and the bytes used) while c was leased."""
    world = World({"a": 1, "b": 1, "c": 1})
    host = world.host(4)
    await used_then_keeping(world, host, "a", 0.8)
    await used_then_keeping(world, host, "b", 0.8)
    async with await host.acquire("c"):
        during = (sorted(m.id for m in host.resident()), host.used_bytes())
    return world, host, during


async def test_a_load_that_fits_once_idle_models_give_back_their_kv_evicts_nobody():
    world, host, (resident, used) = await c_loaded_beside_a_and_b_keeping_kv()
    assert resident == ["a", "b", "c"] and used <= 4 * GB
    assert "drain a" not in world.log and "drain b" not in world.log
    host.check_invariants()


async def test_the_least_recently_used_model_gives_back_first_and_the_latest_keeps_its_kv():
    world, _, _ = await c_loaded_beside_a_and_b_keeping_kv()
    assert world.units["a"].given_back == 1 and world.units["b"].given_back == 0
    assert world.units["b"].kept_bytes == int(0.8 * GB)


async def test_when_giving_back_is_not_enough_the_least_recently_used_model_is_evicted():
    world = World({"a": 2, "b": 1, "c": 2})
    host = world.host(4)
    await used_then_keeping(world, host, "a", 0.5)
    await used_then_keeping(world, host, "b", 0.2)
    async with await host.acquire("c"):
        assert sorted(m.id for m in host.resident()) == ["b", "c"]
    assert world.units["a"].given_back == 1 and world.units["b"].given_back == 1
    assert world.log[-4:] == ["drain a", "flush a", "release a", "load c"]


async def test_a_model_that_gave_back_keeps_its_kv_again_after_its_next_request():
    world = World({"a": 1, "c": 2.5, "d": 0.4})
    host = world.host(4)
    await used_then_keeping(world, host, "a", 1)
    async with await host.acquire("c"):
        pass
    await used_then_keeping(world, host, "a", 1)
    async with await host.acquire("d"):
        assert sorted(m.id for m in host.resident()) == ["a", "c", "d"]
    assert world.units["a"].given_back == 2 and world.num_loads == 3


async def test_a_models_next_request_that_would_evict_another_has_it_give_back_its_own_kv():
    world = World({"a": 1, "b": 1}, claims_gb={"a": (1.0, 1.0)})
    host = world.host(3.2)
    await used_then_keeping(world, host, "a", 0.8)
    async with await host.acquire("b"):
        pass
    async with await host.acquire("a"):
        assert sorted(m.id for m in host.resident()) == ["a", "b"]
    assert world.units["a"].given_back == 1 and "drain b" not in world.log


async def test_a_model_alone_above_its_budget_keeps_its_kv_for_its_next_request():
    world = World({"a": 1}, claims_gb={"a": (1.0, 1.0)})
    host = world.host(1.5)
    await used_then_keeping(world, host, "a", 0.8)
    async with await host.acquire("a"):
        pass
    assert world.units["a"].given_back == 0
