"""Operator routes: load, pin, unpin and unload a model by id, and switch the current model."""

from __future__ import annotations

import httpx
from routed_world import RoutedWorld


def client_for(world: RoutedWorld) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=world.app), base_url="http://t")


async def test_an_operator_loads_pins_and_unloads_a_model_by_id():
    world = RoutedWorld({"a": 1, "org/b": 1}, budget_mb=10)
    async with client_for(world) as client:
        loaded = await client.post("/api/models/org/b/load")
        assert loaded.json() == {"id": "org/b", "resident": True, "pinned": False}
        pinned = await client.post("/api/models/a/pin")
        assert pinned.json() == {"id": "a", "resident": True, "pinned": True}
        assert (await client.post("/api/models/a/unpin")).json()["pinned"] is False
        unloaded = await client.post("/api/models/org/b/unload")
        assert unloaded.json() == {"id": "org/b", "resident": False, "flushed": True}
        assert [m.id for m in world.host.resident()] == ["a"]
        missing = await client.post("/api/models/nope/load")
        assert missing.status_code == 404


async def test_unload_refuses_a_model_that_is_answering_unless_forced():
    world = RoutedWorld({"a": 1}, budget_mb=10)
    async with client_for(world) as client:
        lease = await world.host.acquire("a")
        refused = await client.post("/api/models/a/unload")
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "in-use"
        forced = await client.post("/api/models/a/unload?force=1")
        assert forced.json()["resident"] is False
        lease.release()


async def test_hub_serve_makes_a_model_current_and_naming_one_in_a_request_does_not():
    world = RoutedWorld({"a": 1, "b": 1}, budget_mb=10)
    async with client_for(world) as client:
        switched = await client.post("/api/hub/serve", json={"model": "b"})
        assert switched.json() == {"current": "b"}
        rows = (await client.get("/v1/models")).json()["data"]
        assert [(r["id"], r["current"]) for r in rows] == [("b", True), ("a", False)]
        refused = await client.post("/api/hub/serve", json={"model": "nope"})
        assert refused.status_code == 400 and world.router.current == "b"
