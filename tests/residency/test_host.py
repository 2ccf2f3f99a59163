"""The residency host's behaviour, case by case, with fake units of known sizes (GB = 10⁹ bytes)."""

from __future__ import annotations

import asyncio

import pytest
from fake_units import GB, FakeUnit, World, settle

from modelhost.residency.host import ResidencyError


def used_gb(host) -> float:
    return host.used_bytes() / GB


async def test_models_that_fit_load_beside_each_other_and_are_served_without_a_second_load():
    world = World({"a": 1, "b": 1})
    host = world.host(4)
    async with await host.acquire("a"), await host.acquire("b"):
        pass
    async with await host.acquire("a"):
        pass
    assert world.loaded() == ["a", "b"]
    assert sorted(m.id for m in host.resident()) == ["a", "b"]
    host.check_invariants()


async def test_a_model_that_does_not_fit_evicts_the_least_recently_used_one_first():
    world = World({"a": 2, "b": 2, "c": 2})
    host = world.host(4)
    for model_id in ("a", "b", "a"):
        async with await host.acquire(model_id):
            host.check_invariants()
    async with await host.acquire("c"):
        assert used_gb(host) <= 4
        host.check_invariants()
    assert world.log[-4:] == ["drain b", "flush b", "release b", "load c"]
    assert sorted(m.id for m in host.resident()) == ["a", "c"]


async def test_loads_announce_saved_state_adoption_announces_its_time_and_failures_their_reason():
    world = World({"a": 1, "b": 1, "c": 1}, saved={"a"})
    world.failures["b"] = "weights are corrupt"
    host = world.host(4)
    host.adopt(world.entry("c"), FakeUnit("c", world.log), load_ms=1234.0)
    async with await host.acquire("a"):
        pass
    with pytest.raises(ResidencyError):
        await host.acquire("b")
    loads = [payload for name, payload in world.events if name == "model.load"]
    adopted = next(p for p in loads if p["id"] == "c")
    assert adopted["phase"] == "finished" and adopted["ms"] == 1234.0
    finished_a = next(p for p in loads if p["id"] == "a" and p["phase"] == "finished")
    assert finished_a["resumed"] is True
    failed_b = next(p for p in loads if p["id"] == "b" and p["phase"] == "failed")
    assert "weights are corrupt" in failed_b["error"]


async def test_a_model_the_loader_already_loaded_is_resident_with_its_time_and_may_be_pinned():
    world = World({"a": 1})
    host = world.host(4)
    host.adopt(world.entry("a"), FakeUnit("a", world.log), pin=True, load_ms=50.0)
    [model] = host.resident()
    assert (model.id, model.state, model.pinned, model.leases) == ("a", "ready", True, 0)
    with pytest.raises(ResidencyError) as refused:
        host.adopt(world.entry("a"), FakeUnit("a", world.log))
    assert refused.value.code == "already-resident"
    async with await host.acquire("a"):
        pass
    assert world.num_loads == 0


async def test_acquiring_an_evicted_model_reloads_it_and_it_is_not_lent_out_while_it_drains():
    world = World({"a": 3, "b": 3})
    host = world.host(4)
    async with await host.acquire("a"):
        pass
    world_units_a = world.units["a"]
    world_units_a.drain_gate = asyncio.Event()
    b = asyncio.create_task(host.acquire("b"))
    await settle()
    assert host.resident()[0].state == "draining"
    again = asyncio.create_task(host.acquire("a"))
    await settle()
    assert not again.done()  # no lease on a draining engine
    world_units_a.drain_gate.set()
    lease_b = await b
    await settle()
    assert not again.done()  # a now waits for b's lease
    lease_b.release()
    lease_a = await again
    assert lease_a.unit is not world_units_a
    assert world.loaded() == ["a", "b", "a"]
    lease_a.release()
    host.check_invariants()


async def test_a_leased_model_is_never_evicted_the_newcomer_waits_then_swaps_without_thrashing():
    world = World({"a": 2, "b": 2, "c": 2})
    host = world.host(4)
    lease_a = await host.acquire("a")
    lease_b = await host.acquire("b")
    waiting = asyncio.create_task(host.acquire("c"))
    await settle()
    assert not waiting.done() and world.loaded() == ["a", "b"]
    assert not any(line.startswith("drain") for line in world.log)
    lease_b.release()
    lease_c = await waiting
    assert [line for line in world.log if line.startswith(("drain", "load"))] == [
        "load a", "load b", "drain b", "load c"
    ]  # fmt: skip
    lease_a.release()
    lease_c.release()
    host.check_invariants()


async def test_a_waiting_request_stops_when_its_client_leaves_and_leaves_nothing_behind():
    world = World({"a": 3, "b": 3})
    host = world.host(4)
    lease_a = await host.acquire("a")
    waiting = asyncio.create_task(host.acquire("b"))
    await settle()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    lease_a.release()
    await settle()
    assert world.loaded() == ["a"]
    assert [(m.id, m.leases) for m in host.resident()] == [("a", 0)]
    host.check_invariants()


async def test_pinned_models_are_never_evicted_and_a_plan_lists_the_victims_it_needs():
    world = World({"a": 1, "b": 3, "d": 4})
    host = world.host(5)
    for model_id in ("a", "b"):
        async with await host.acquire(model_id):
            pass
    host.pin("a")
    plan = host.plan("d")
    assert (plan.fits, plan.required_bytes, plan.free_bytes, plan.evict) == (
        True,
        4 * GB,
        GB,
        ("b",),
    )
    async with await host.acquire("d"):
        pass
    assert sorted(m.id for m in host.resident()) == ["a", "d"]
    assert host.plan("a").required_bytes == 0


async def test_a_plan_lists_victims_least_recently_used_first():
    world = World({"a": 1, "b": 2, "c": 2, "d": 4})
    host = world.host(6)
    for model_id in ("a", "b", "c", "b"):
        async with await host.acquire(model_id):
            pass
    host.pin("a")
    assert host.plan("d").evict == ("c", "b")


async def test_a_model_bigger_than_the_budget_is_served_alone_after_everything_unpinned_leaves():
    world = World({"a": 1, "b": 1, "huge": 10})
    host = world.host(4)
    lease_a = await host.acquire("a")
    async with await host.acquire("b"):
        pass
    waiting = asyncio.create_task(host.acquire("huge"))
    await settle()
    assert not waiting.done()  # a is leased: it cannot leave yet
    lease_a.release()
    async with await waiting:
        assert [m.id for m in host.resident()] == ["huge"]
        host.check_invariants()


async def test_a_model_the_machine_cannot_hold_is_refused_before_anything_loads():
    world = World({"a": 1, "b": 1, "huge": 10})
    host = world.host(4, available=lambda: 5 * GB)  # the machine, not the budget
    async with await host.acquire("a"):
        pass
    host.pin("b")
    async with await host.acquire("b"):
        pass
    with pytest.raises(ResidencyError, match="'huge' needs 10.00 GB") as refused:
        await host.acquire("huge")
    assert refused.value.code == "does-not-fit"
    assert world.loaded() == ["a", "b"]  # nothing was evicted for it either
    host.check_invariants()


async def test_a_model_bigger_than_the_budget_that_the_machine_holds_once_others_leave_loads():
    world = World({"a": 1, "huge": 5})
    host = world.host(4, available=lambda: 4 * GB)  # with a's 1 GB back, 5 GB
    async with await host.acquire("a"):
        pass
    async with await host.acquire("huge"):
        assert [m.id for m in host.resident()] == ["huge"]


async def test_a_loading_model_shows_how_far_its_load_has_got():
    world = World({"a": 1})
    world.progress_steps["a"] = [0.25, 0.5]
    world.gates["a"] = asyncio.Event()
    host = world.host(4)
    waiting = asyncio.create_task(host.acquire("a"))
    await settle()
    [loading] = host.resident()
    assert (loading.state, loading.progress) == ("loading", 0.5)
    world.gates["a"].set()
    async with await waiting:
        [ready] = host.resident()
        assert (ready.state, ready.progress) == ("ready", None)


async def test_measured_memory_floors_the_estimates_so_a_full_process_still_evicts():
    world = World({"a": 1, "b": 2})
    process_bytes = [0]
    host = world.host(4, measure=lambda: process_bytes[0])
    async with await host.acquire("a"):
        pass
    process_bytes[0] = 3 * GB  # the process holds more than the estimates say
    async with await host.acquire("b"):
        pass
    assert [m.id for m in host.resident()] == ["b"]


async def test_a_units_measured_bytes_replace_its_estimate_once_it_has_reported():
    world = World({"a": 2, "b": 2})
    host = world.host(4)
    async with await host.acquire("a"):
        pass
    assert host.resident()[0].bytes == 2 * GB  # before its first report the estimate stands
    world.units["a"].measured = 3 * GB
    assert host.resident()[0].bytes == 3 * GB
    async with await host.acquire("b"):
        pass
    assert [m.id for m in host.resident()] == ["b"]  # 3 + 2 > 4: a had to leave


async def test_the_host_asks_residents_for_a_current_reading_before_it_decides():
    world = World({"a": 2, "b": 2})
    host = world.host(4)
    async with await host.acquire("a"):
        pass
    world.units["a"].reading = 3 * GB  # not pushed: only a refresh finds it
    async with await host.acquire("b"):
        pass
    assert [m.id for m in host.resident()] == ["b"]


async def test_a_unit_that_measures_less_than_its_estimate_frees_room_for_a_newcomer():
    world = World({"a": 3, "b": 2}, weights_gb={"a": 1})
    host = world.host(4)
    async with await host.acquire("a"):
        pass
    world.units["a"].measured = 1 * GB  # the estimate's KV and working memory were not needed
    async with await host.acquire("b"):
        pass
    assert sorted(m.id for m in host.resident()) == ["a", "b"]
    assert not any(line.startswith("drain") for line in world.log)


async def test_residents_the_host_does_not_manage_count_against_the_budget():
    world = World({"a": 2, "b": 2})
    host = world.host(4, external=lambda: 1 * GB)
    async with await host.acquire("a"):
        pass
    async with await host.acquire("b"):
        pass
    assert [m.id for m in host.resident()] == ["b"]


async def test_make_room_drains_lru_models_until_the_bytes_fit_and_waits_while_all_are_leased():
    world = World({"a": 2, "b": 2})
    host = world.host(4)
    lease_a = await host.acquire("a")
    async with await host.acquire("b"):
        pass
    await host.make_room(2 * GB)
    assert [m.id for m in host.resident()] == ["a"]
    room = asyncio.create_task(host.make_room(3 * GB))
    await settle()
    assert not room.done()
    lease_a.release()
    await room
    assert host.resident() == []


async def test_concurrent_requests_for_one_model_share_one_load_and_each_hold_a_lease():
    world = World({"a": 1})
    world.gates["a"] = asyncio.Event()
    host = world.host(4)
    acquirers = [asyncio.create_task(host.acquire("a")) for _ in range(3)]
    await settle()
    assert host.resident()[0].state == "loading" and host.resident()[0].leases == 3
    world.gates["a"].set()
    leases = await asyncio.gather(*acquirers)
    assert world.num_loads == 1 and host.resident()[0].leases == 3
    for lease in leases:
        lease.release()
        lease.release()  # idempotent
    assert host.resident()[0].leases == 0
    host.check_invariants()


async def test_a_failed_load_rejects_with_load_failed_leaks_no_lease_and_can_be_retried():
    world = World({"a": 1})
    world.failures["a"] = "out of memory"
    host = world.host(4)
    with pytest.raises(ResidencyError) as failed:
        await host.acquire("a")
    assert failed.value.code == "load-failed" and "out of memory" in failed.value.message
    assert host.resident() == []
    async with await host.acquire("a"):
        assert host.resident()[0].leases == 1
    assert host.resident()[0].leases == 0


async def test_unknown_ids_and_missing_operations_are_refused_before_anything_loads():
    world = World({"a": 1}, operations={"a": ("generate",)})
    host = world.host(4)
    for model_id, need in (("nope", None), ("../a", None), ("a", "embed")):
        with pytest.raises(ResidencyError) as refused:
            await host.acquire(model_id, need=need)
        assert refused.value.code == "does-not-fit"
    assert world.num_loads == 0


async def test_unload_refuses_a_leased_model_unless_forced_and_reports_what_it_saved():
    world = World({"a": 1, "b": 1})
    host = world.host(4)
    lease = await host.acquire("a")
    with pytest.raises(ResidencyError) as refused:
        await host.unload("a")
    assert refused.value.code == "in-use"
    assert await host.unload("a", force=True) is True
    lease.release()
    async with await host.acquire("b"):
        pass
    world.units["b"].flushed = False
    assert await host.unload("b") is False
    assert await host.unload("never-loaded") is None
    assert host.resident() == []


async def test_pausing_stops_every_resident_and_holds_back_new_loads_until_disposed():
    world = World({"a": 1, "b": 1, "c": 1})
    host = world.host(4)
    for model_id in ("b", "a"):
        async with await host.acquire(model_id):
            pass
    pause = await host.pause_all()
    assert world.log[-2:] == ["pause a", "pause b"]  # a stable id order
    async with await host.acquire("a"):  # a resident model still serves
        pass
    waiting = asyncio.create_task(host.acquire("c"))
    await settle()
    assert not waiting.done()
    pause.dispose()
    pause.dispose()
    async with await waiting:
        pass
    assert world.log.count("resume a") == 1 and world.loaded() == ["b", "a", "c"]


async def test_pausing_waits_for_a_draining_model_instead_of_pausing_it():
    world = World({"a": 1})
    host = world.host(4)
    async with await host.acquire("a"):
        pass
    world.units["a"].drain_gate = asyncio.Event()
    unloading = asyncio.create_task(host.unload("a"))
    await settle()
    pausing = asyncio.create_task(host.pause_all())
    await settle()
    assert not pausing.done()
    world.units["a"].drain_gate.set()
    pause = await pausing
    await unloading
    assert "pause a" not in world.log
    pause.dispose()


async def test_close_drains_every_model_including_pinned_waits_for_a_load_and_then_refuses():
    world = World({"a": 1, "b": 1})
    host = world.host(4)
    async with await host.acquire("a"):
        pass
    host.pin("a")
    world.gates["b"] = asyncio.Event()
    loading = asyncio.create_task(host.acquire("b"))
    await settle()
    closing = host.close()
    assert host.close() is closing
    await settle()
    assert not closing.done()  # the load in flight is waited for
    world.gates["b"].set()
    await closing
    with pytest.raises(ResidencyError) as refused:
        await loading
    assert refused.value.code == "closed"
    assert {"drain a", "drain b"} <= set(world.log)
    assert host.resident() == []
    with pytest.raises(ResidencyError) as after:
        await host.acquire("a")
    assert after.value.code == "closed"


async def test_a_unit_that_could_not_save_its_state_is_still_released_and_says_so():
    world = World({"a": 1})
    host = world.host(4)
    async with await host.acquire("a"):
        pass
    world.units["a"].flushed = False
    await host.unload("a")
    unloads = [payload for name, payload in world.events if name == "model.unload"]
    assert unloads[-1]["flushed"] is False and host.resident() == []


async def test_a_host_switches_through_its_switch_and_without_one_says_it_holds_one_model():
    switched: list[str] = []

    async def switch(model_id: str) -> None:
        switched.append(model_id)

    world = World({"a": 1})
    await world.host(4, switch=switch).serve("a")
    assert switched == ["a"]
    with pytest.raises(ResidencyError) as refused:
        await world.host(4).serve("a")
    assert refused.value.code == "not-switchable"


async def test_a_broken_unit_with_no_leases_is_evicted_and_reloaded():
    world = World({"a": 1})
    host = world.host(4)
    async with await host.acquire("a"):
        pass
    world.units["a"].is_broken = True
    async with await host.acquire("a") as lease:
        assert not lease.unit.is_broken
    assert world.loaded() == ["a", "a"]


async def test_a_model_just_released_is_held_for_its_hold_unless_the_waiter_is_older():
    world = World({"a": 2, "b": 2, "c": 2})
    host = world.host(4, hold_s=1000.0)
    async with await host.acquire("a"):
        pass
    async with await host.acquire("b"):
        pass
    waiting = asyncio.create_task(host.acquire("c"))
    await settle()
    assert not waiting.done()  # both are inside their hold
    world.now += 2000.0  # the waiter is now older than the hold
    host._wake()
    async with await waiting:
        pass
    assert "drain a" in world.log and "drain b" not in world.log


def test_a_budget_that_is_not_positive_is_refused():
    with pytest.raises(ValueError, match="must be positive"):
        World({}).host(0)


async def test_keep_alive_zero_lets_a_model_go_once_its_last_lease_ends():
    world = World({"a": 1})
    host = world.host(4)
    async with await host.acquire("a"), await host.acquire("a"):
        assert host.keep_alive("a", 0)
    await settle()
    assert "release a" in world.log
    assert host.resident() == []


async def test_keep_alive_zero_on_an_idle_model_lets_it_go_at_once():
    world = World({"a": 1})
    host = world.host(4)
    async with await host.acquire("a"):
        pass
    host.keep_alive("a", 0)
    await settle()
    assert host.resident() == []


async def test_keep_alive_below_zero_pins_and_a_duration_unpins_and_holds_that_long():
    world = World({"a": 2, "b": 2, "c": 2})
    host = world.host(4)
    async with await host.acquire("a"):
        host.keep_alive("a", -1)
    assert [m.pinned for m in host.resident()] == [True]
    async with await host.acquire("a"):
        host.keep_alive("a", 600.0)
    [a] = host.resident()
    assert not a.pinned and a.hold_s == 600.0
    async with await host.acquire("b"):
        pass
    waiting = asyncio.create_task(host.acquire("c"))
    await settle()
    assert "drain b" in world.log and "drain a" not in world.log  # a is inside its hold
    async with await waiting:
        pass


def test_keep_alive_of_a_model_not_resident_changes_nothing():
    assert World({"a": 1}).host(4).keep_alive("a", -1) is False
