"""The model router: which model answers a request, how long it stays leased, and what the
discovery and status routes say about residency. Scripted models answer `[<their id>]`."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from live_server import LiveServer
from routed_world import MB, RoutedWorld


@pytest.fixture
async def clients() -> AsyncIterator[Any]:
    opened: list[httpx.AsyncClient] = []

    def open_client(world: RoutedWorld) -> httpx.AsyncClient:
        transport = httpx.ASGITransport(app=world.app)
        opened.append(httpx.AsyncClient(transport=transport, base_url="http://testserver"))
        return opened[-1]

    yield open_client
    for client in opened:
        await client.aclose()


def chat(model: Any = None, *, stream: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "stream": stream}
    if model is not None:
        body["model"] = model
    return body


def text_of(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["message"]["content"])


async def test_a_request_naming_an_exact_local_model_is_answered_by_it_anything_else_by_current(
    clients,
):
    world = RoutedWorld({"a": 1, "b": 1}, budget_mb=10)
    client = clients(world)
    assert text_of(await client.post("/v1/chat/completions", json=chat("b"))) == "[b]"
    for other in (None, "gpt-4", "local", 42):
        assert text_of(await client.post("/v1/chat/completions", json=chat(other))) == "[a]"
    assert world.loads == ["b", "a"]
    assert world.router.current == "a"  # naming a model never changes the current one
    refused = await client.post("/v1/chat/completions", content=b"not json")
    assert refused.status_code == 400 and world.loads == ["b", "a"]


def test_the_lease_is_held_until_the_body_ends_is_cancelled_or_fails_and_never_longer():
    world = RoutedWorld({"a": 1}, budget_mb=10, step_s=0.03)  # streams of about 2 s
    with LiveServer(world.app) as server, httpx.Client(base_url=server.base_url) as client:
        with client.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as response:
            lines = response.iter_lines()
            next(lines)
            assert world.leases() == {"a": 1}
            assert any("[DONE]" in line for line in lines)
        wait_for(lambda: world.leases() == {"a": 0})
        with client.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as response:
            lines = response.iter_lines()  # kept: a dropped line iterator closes the response
            next(lines)
            assert world.leases() == {"a": 1}
        wait_for(lambda: world.leases() == {"a": 0})  # the client left mid-stream
        world.engines["a"].fail_after = 2
        with client.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as response:
            frames = [line for line in response.iter_lines() if line.startswith("data:")]
        assert '"error"' in frames[-1]
        wait_for(lambda: world.leases() == {"a": 0})
        world.engines["a"].fail_after = None
        assert text_of(client.post("/v1/chat/completions", json=chat())) == "[a]" * 20
        wait_for(lambda: world.leases() == {"a": 0})  # a JSON body: released once it is sent


def test_an_evictable_model_is_not_released_under_a_stream_a_swap_waits_for_its_end():
    world = RoutedWorld({"a": 6, "b": 6}, budget_mb=10, step_s=0.05)  # streams of 3 s
    with LiveServer(world.app) as server, httpx.Client(base_url=server.base_url) as client:
        answers: list[str] = []
        with client.stream("POST", "/v1/chat/completions", json=chat("a", stream=True)) as stream:
            lines = stream.iter_lines()
            next(lines)
            other = threading.Thread(
                target=lambda: answers.append(
                    text_of(client.post("/v1/chat/completions", json=chat("b"), timeout=30))
                )
            )
            other.start()
            time.sleep(0.3)
            assert world.loads == ["a"] and not answers  # b waits for a's stream
            assert any("[DONE]" in line for line in lines)
        other.join(timeout=30)
    assert answers == ["[b]" * 20] and world.loads == ["a", "b"]
    assert [name for name, p in world.events if name == "model.unload"] == ["model.unload"] * 2


async def test_a_model_that_cannot_be_leased_answers_with_a_typed_error_and_holds_nothing(
    clients,
):
    world = RoutedWorld({"a": 1, "broken": 1}, budget_mb=10, failing={"broken"})
    client = clients(world)
    failed = await client.post("/v1/chat/completions", json=chat("broken"))
    assert failed.status_code == 502
    error = failed.json()["error"]
    assert (error["type"], error["code"]) == ("model_load_failed", "load-failed")
    assert "weights are corrupt" in error["message"]
    anthropic = await client.post(
        "/v1/messages", json={"model": "broken", "max_tokens": 5, "messages": chat()["messages"]}
    )
    assert anthropic.status_code == 502 and anthropic.json()["type"] == "error"
    assert world.host.resident() == []
    await world.host.close()
    closing = await client.post("/v1/chat/completions", json=chat("a"))
    assert closing.status_code == 503
    assert closing.json()["error"]["type"] == "server_closing"


async def test_a_client_that_leaves_while_its_model_loads_gets_499_and_leaks_no_lease():
    world = RoutedWorld({"a": 1}, budget_mb=10)
    world.gates["a"] = asyncio.Event()
    leave = asyncio.Event()
    sent: list[dict[str, Any]] = []
    body = json.dumps(chat("a")).encode()
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        await leave.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": [],
        "query_string": b"", "asgi": {"version": "3.0"}, "http_version": "1.1",
        "scheme": "http", "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1), "root_path": "",
    }  # fmt: skip
    call = asyncio.create_task(world.app(scope, receive, send))
    await asyncio.sleep(0.05)
    assert world.leases() == {"a": 1}  # loading, on this request's behalf
    leave.set()
    await call
    assert sent[0]["status"] == 499
    world.gates["a"].set()
    await wait_until(lambda: world.leases() == {"a": 0})
    world.host.check_invariants()


async def test_v1_models_lists_every_local_model_with_residency_current_first(clients):
    world = RoutedWorld({"z": 1, "b": 1, "a": 1}, budget_mb=10)
    client = clients(world)
    assert text_of(await client.post("/v1/chat/completions", json=chat("b"))) == "[b]"
    rows = (await client.get("/v1/models")).json()["data"]
    assert [(r["id"], r["resident"], r["current"]) for r in rows] == [
        ("a", False, True), ("b", True, False), ("z", False, False)
    ]  # fmt: skip
    assert rows[1]["context_window"] > 0  # a resident model answers for itself
    one = await client.get("/v1/models/b")
    assert one.json()["id"] == "b" and one.json()["resident"] is True
    assert (await client.get("/v1/models/nope")).status_code == 404


async def test_a_loading_model_is_listed_as_loading_with_how_far_it_has_got(clients):
    world = RoutedWorld({"a": 1, "b": 1}, budget_mb=10, progress={"b": 0.4})
    world.gates["b"] = asyncio.Event()
    client = clients(world)
    asking = asyncio.create_task(client.post("/v1/chat/completions", json=chat("b")))
    await wait_until(lambda: world.leases() == {"b": 1})
    rows = {row["id"]: row for row in (await client.get("/v1/models")).json()["data"]}
    assert (rows["b"]["state"], rows["b"]["progress"], rows["b"]["resident"]) == (
        "loading", 0.4, False
    )  # fmt: skip
    assert rows["a"]["state"] == "available" and "progress" not in rows["a"]
    [loading] = (await client.get("/stats")).json()["models"]["resident"]
    assert (loading["id"], loading["state"], loading["progress"]) == ("b", "loading", 0.4)
    world.gates["b"].set()
    assert text_of(await asking) == "[b]"
    row = (await client.get("/v1/models/b")).json()
    assert (row["state"], row["resident"]) == ("ready", True) and "progress" not in row


async def test_a_model_the_registry_refuses_is_listed_with_why_and_a_request_gets_a_400(clients):
    refusal = "tensor blk.0.ffn_down.weight is IQ2_XS, which modelhost does not run"
    world = RoutedWorld({"a": 1, "iq": 1}, budget_mb=10, refusals={"iq": refusal})
    client = clients(world)
    refused = await client.post("/v1/chat/completions", json=chat("iq"))
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert (error["code"], error["param"]) == ("unsupported-model", "model")
    assert refusal in error["message"]
    assert world.loads == []
    row = (await client.get("/v1/models/iq")).json()
    assert row["refusal"] == refusal


async def test_stats_reports_the_hosts_residency(clients):
    world = RoutedWorld({"a": 2, "b": 3}, budget_mb=10)
    client = clients(world)
    for model in ("a", "b"):
        await client.post("/v1/chat/completions", json=chat(model))
    stats = (await client.get("/stats")).json()
    models = stats["models"]
    assert (models["current"], models["budget_bytes"], models["resident_bytes"]) == (
        "a", 10 * MB, 5 * MB
    )  # fmt: skip
    rows = [(m["id"], m["state"], m["bytes"], m["pinned"], m["leases"]) for m in models["resident"]]
    assert rows == [("a", "ready", 2 * MB, False, 0), ("b", "ready", 3 * MB, False, 0)]
    assert stats["server"]["model"] == "a"  # the current model answers the rest


async def test_everything_else_model_scoped_belongs_to_the_current_model_and_never_loads(clients):
    world = RoutedWorld({"a": 1, "b": 1}, budget_mb=10)
    client = clients(world)
    unmatched = await client.post("/v1/unknown", json={"model": "b"})
    assert unmatched.status_code == 404 and world.loads == []  # nothing resident: falls through
    await client.post("/v1/chat/completions", json=chat("a"))
    assert (await client.post("/v1/unknown", json={})).status_code == 404
    assert world.leases() == {"a": 0} and world.loads == ["a"]
    counted = await client.post(
        "/v1/messages/count_tokens", json={"model": "b", "messages": chat()["messages"]}
    )
    assert counted.status_code == 200 and world.loads == ["a", "b"]


async def test_with_no_model_resident_reads_fall_through_and_health_still_answers(clients):
    world = RoutedWorld({"a": 1}, budget_mb=10)
    client = clients(world)
    assert (await client.get("/health")).json() == {"status": "ok"}
    stats = await client.get("/stats")
    assert stats.status_code == 200 and stats.json()["models"]["resident"] == []
    assert "unavailable" in stats.json()
    assert [r["resident"] for r in (await client.get("/v1/models")).json()["data"]] == [False]
    assert world.loads == []


async def test_the_routing_field_is_the_json_bodys_string_model_and_nothing_else(clients):
    world = RoutedWorld({"a": 1, "b": 1}, budget_mb=10)
    client = clients(world)
    url = "/v1/chat/completions"
    assert text_of(await client.post(f"{url}?model=b", json=chat())) == "[a]"
    assert text_of(await client.post(url, json=chat(), headers={"x-model": "b"})) == "[a]"
    nested = {**chat(), "metadata": {"model": "b"}}
    assert text_of(await client.post(url, json=nested)) == "[a]"
    assert text_of(await client.post(url, json=chat("b"))) == "[b]"


def wait_for(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


async def wait_until(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)
