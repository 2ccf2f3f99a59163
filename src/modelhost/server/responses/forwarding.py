"""A Responses turn served by a worker process, with the stored turns kept by the front.

The store of past answers is protocol state, so it is the front's: it outlives the worker that
wrote an answer (an eviction, a respawn). For each `POST /v1/responses` the front forwards to a
worker it names the response (`RESPONSE_ID_HEADER`), puts the stored turn that
`previous_response_id` names into the body (`FORWARDED_TURN_FIELD`; a client's own value of it
is dropped), and once the worker's answer has ended takes that answer from the worker's store
(`POST /admin/responses/take`) into its own. Meanwhile the id is expected: a lookup of it waits
until it is settled.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
from starlette.types import Scope

from modelhost.residency.workers.worker_unit import WorkerUnit
from modelhost.server.front.worker_proxy import Forwarded
from modelhost.server.responses.routes import FORWARDED_TURN_FIELD, RESPONSE_ID_HEADER, new_id
from modelhost.server.responses.store import ResponseStore, StoredResponse

TAKE_TIMEOUT_S = 10.0


async def forward_turn(scope: Scope, body: bytes) -> Forwarded:
    """The request as the worker gets it, and how the front keeps its answer."""
    store: ResponseStore = scope["app"].state.response_store
    response_id = new_id("resp")
    store.expect(response_id)
    forwarded = await _with_stored_turn(body, store)

    async def settle(unit: WorkerUnit) -> None:
        try:
            answer = await take_answer(unit, response_id)
            if answer is not None:
                store.put(response_id, answer)
        finally:
            store.settle(response_id)

    headers = [(RESPONSE_ID_HEADER.encode(), response_id.encode())]
    return Forwarded(forwarded, headers, settle)


async def _with_stored_turn(body: bytes, store: ResponseStore) -> bytes:
    """`body` with the stored turn its `previous_response_id` names, when the store has it (the
    worker refuses a turn it is not given, as the store would)."""
    try:
        value: Any = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return body  # the worker's own parser refuses it
    if not isinstance(value, dict):
        return body
    changed = value.pop(FORWARDED_TURN_FIELD, None) is not None
    previous = value.get("previous_response_id")
    if isinstance(previous, str):
        prior = await store.get_settled(previous)
        if prior is not None:
            value[FORWARDED_TURN_FIELD] = prior.to_json()
            changed = True
    return json.dumps(value, ensure_ascii=False).encode() if changed else body


async def take_answer(unit: WorkerUnit, response_id: str) -> StoredResponse | None:
    """The stored answer `response_id`, taken from the worker's store (None: there is none, or
    the worker cannot be reached)."""
    try:
        taken = await unit.client().post(
            "/admin/responses/take", json={"id": response_id}, timeout=TAKE_TIMEOUT_S
        )
        return StoredResponse.from_json(taken.json()) if taken.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError):
        return None
