"""ResponseStore: expiry after its TTL, least-recently-used eviction under its byte cap, and
what the front does with a worker's answers (take, wait for an expected one)."""

from __future__ import annotations

import asyncio
import json

from modelhost.server.responses.store import ResponseStore, StoredResponse


def entry(text: str = "x") -> StoredResponse:
    return StoredResponse(
        input_items=[{"role": "user", "content": text}],
        output_items=[{"type": "message", "content": text}],
        instructions=None,
        response={"id": "r"},
    )


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_store_returns_what_was_put() -> None:
    store = ResponseStore()
    stored = entry()
    assert store.put("a", stored)
    assert store.get("a") is stored
    assert store.get("b") is None


def test_store_forgets_an_entry_once_its_ttl_has_passed() -> None:
    clock = Clock()
    store = ResponseStore(ttl_s=10, clock=clock)
    store.put("a", entry())
    clock.now = 9.9
    assert store.get("a") is not None
    clock.now = 10.0
    assert store.get("a") is None
    assert store.stats().entries == 0
    assert store.stats().num_bytes == 0


def test_store_evicts_the_least_recently_used_entry_when_over_its_byte_cap() -> None:
    size = entry().num_bytes
    store = ResponseStore(max_bytes=2 * size)
    store.put("a", entry())
    store.put("b", entry())
    store.get("a")  # now "b" is the least recently used
    store.put("c", entry())
    assert store.get("b") is None
    assert store.get("a") is not None and store.get("c") is not None
    store.check_invariants()


def test_store_keeps_nothing_for_an_entry_larger_than_its_cap() -> None:
    store = ResponseStore(max_bytes=10)
    assert not store.put("a", entry("a long answer"))
    assert store.get("a") is None
    assert store.stats().num_bytes == 0


def test_store_counts_a_replaced_entry_once() -> None:
    store = ResponseStore()
    store.put("a", entry("short"))
    store.put("a", entry("a much longer answer"))
    assert store.stats().entries == 1
    assert store.stats().num_bytes == entry("a much longer answer").num_bytes
    store.check_invariants()


def test_a_taken_entry_leaves_the_store() -> None:
    store = ResponseStore()
    store.put("a", entry())
    assert store.take("a") == entry()
    assert store.get("a") is None and store.stats().num_bytes == 0


def test_an_entry_crosses_processes_as_json_unchanged() -> None:
    assert StoredResponse.from_json(json.loads(json.dumps(entry().to_json()))) == entry()


async def test_a_lookup_of_an_expected_response_waits_until_it_is_settled() -> None:
    store = ResponseStore()
    store.expect("a")
    lookup = asyncio.create_task(store.get_settled("a"))
    await asyncio.sleep(0.01)
    assert not lookup.done()
    store.put("a", entry())
    store.settle("a")
    assert await lookup == entry()


async def test_a_lookup_of_a_response_not_expected_answers_at_once() -> None:
    assert await ResponseStore().get_settled("a", timeout_s=60) is None
