"""The budget counts what a model holds plus what its leases may still claim of a KV pool that
grows with use: idle models cost their estimate, and a burst of long requests queues at the
host or drains idle models instead of overrunning the budget (GB = 10⁹ bytes)."""

from __future__ import annotations

import asyncio

from fake_units import GB, World, settle

from modelhost.residency.unit import claim_bytes


def burst_world() -> World:
    # Each model: 0.5 GB held idle; a lease claims 1 GB of KV (a full context), 2 GB at most.
    return World({"a": 0.5, "b": 0.5, "c": 0.5}, claims_gb={m: (1.0, 2.0) for m in "abc"})


def test_a_lease_claims_a_full_context_a_row_and_never_more_than_the_pool():
    entry = burst_world().entry("a")
    assert entry is not None
    assert [claim_bytes(entry, rows) / GB for rows in range(4)] == [0, 1, 2, 2]


async def test_idle_models_cost_only_what_they_hold():
    world = burst_world()
    host = world.host(2.5)  # room for the three held and one request's claim
    for model_id in "abc":
        async with await host.acquire(model_id):
            pass
    assert sorted(m.id for m in host.resident()) == ["a", "b", "c"]
    assert host.used_bytes() == int(1.5 * GB)
    host.check_invariants()


async def test_a_busy_model_counts_its_leases_claims_on_top_of_what_it_holds():
    world = burst_world()
    host = world.host(4)
    async with await host.acquire("a"), await host.acquire("a"):
        assert host.used_bytes() == int(2.5 * GB)  # 0.5 held + 2 GB claimed (the ceiling)
    assert host.used_bytes() == int(0.5 * GB)


async def test_a_burst_of_long_requests_drains_idle_models_to_make_room_for_its_claims():
    world = burst_world()
    host = world.host(3)
    for model_id in "abc":
        async with await host.acquire(model_id):
            pass
    leases = [await host.acquire("a") for _ in range(3)]  # claims 2 GB: 3.5 GB in all
    await settle()
    assert sorted(m.id for m in host.resident()) == ["a", "c"]  # b, used least recently, went
    assert host.used_bytes() == 3 * GB
    host.check_invariants()
    for lease in leases:
        lease.release()


async def test_a_burst_that_only_busy_models_could_make_room_for_waits_and_never_overruns():
    world = burst_world()
    host = world.host(3)
    first_b = await host.acquire("b")  # b: 0.5 held + 1 GB claimed
    first_a = await host.acquire("a")  # a: 0.5 held + 1 GB claimed: 3 GB, the whole budget
    assert host.used_bytes() == 3 * GB
    second_a = asyncio.ensure_future(host.acquire("a"))  # would claim 1 GB more
    await settle()
    assert not second_a.done()  # queued: b is busy, nothing idle can make room
    assert host.used_bytes() <= 3 * GB
    host.check_invariants()
    first_b.release()  # b's claim ends: room for a's second
    lease = await asyncio.wait_for(second_a, 5)
    assert sorted(m.id for m in host.resident()) == ["a", "b"]
    assert host.used_bytes() == 3 * GB  # 0.5 + 2 for a, 0.5 for b
    for done in (lease, first_a):
        done.release()


async def test_loading_a_model_for_a_request_needs_room_for_that_requests_claim():
    world = burst_world()
    host = world.host(2)
    async with await host.acquire("a"):
        pass
    plan = host.plan("b")
    assert plan.required_bytes == int(1.5 * GB)  # 0.5 held + 1 GB the request may claim
    assert plan.fits and plan.evict == ()
    async with await host.acquire("b"):
        assert host.used_bytes() <= 2 * GB
    assert sorted(m.id for m in host.resident()) == ["a", "b"]
