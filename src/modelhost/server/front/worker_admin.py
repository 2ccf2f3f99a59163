"""A worker's private routes, served on its Unix socket only (the parent's TCP app has none).

- `POST /admin/drain {timeout_ms?, force?}`: stop admitting (new requests get 503), wait up to
  `timeout_ms` (default 120 s) for the requests in flight, and say honestly whether they ended;
  with `force`, end whatever still runs (each gets its protocol's `closed` error). The parent
  calls it with `{timeout_ms: 0, force: true}` when its own shutdown deadline comes, so clients of
  a worker see the same clean end as clients of an in-process model.
- `POST /admin/give-back`: an idle engine gives back its KV pool now (the residency host asks
  before it evicts a model for room) → `{given_back, resident_bytes}`; rows running keep it.
- `GET /admin/events`: NDJSON, one `worker.memory` line at connect and one each second the
  figures change (resident bytes, rows running and waiting).
- `POST /admin/memory/complete {call, snapshot?, requests: [{stage?, input: {system?, user},
  maxTokens}]}` → `{outputs: [...]}` in input order: completions for a memory module that sits
  in the parent (reference §4.10), run on this worker's engine without an HTTP surface each.
- `POST /admin/responses/take {id}`: the stored Responses answer `id`, removed from this
  worker's store (404 when there is none): the front keeps the stored answers.
- `POST /admin/adapters {op: load|unload, name, path?}` and `GET /admin/adapters`: this
  worker's LoRA adapters, loaded, unloaded and listed for the front's `/api/adapters`
  (server/front/adapter_admin.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from modelhost.inference.contracts import (
    ChatPrompt,
    InferenceRequest,
    InvalidRequest,
    RequestError,
)
from modelhost.inference.stage import InferenceStage
from modelhost.server.front.adapter_admin import adapter_order, adapter_state
from modelhost.server.http import read_json_object
from modelhost.server.openai.wire import new_id, openai_error
from modelhost.server.responses.store import ResponseStore

DEFAULT_DRAIN_MS = 120_000
EVENTS_INTERVAL_S = 1.0
MAX_MEMORY_REQUESTS = 64


async def drain(request: Request) -> Response:
    try:
        body = await read_json_object(request)
    except RequestError as error:
        return openai_error(error.status, error.body)
    timeout_ms = body.get("timeout_ms", DEFAULT_DRAIN_MS)
    if type(timeout_ms) not in (int, float) or timeout_ms < 0:
        return openai_error(400, {"message": "timeout_ms must be a number >= 0"})
    stage = request.app.state.stage
    stop_admission = getattr(stage, "stop_admission", None)  # a companion has no queue
    if stop_admission is not None:
        stop_admission()
    deadline = time.monotonic() + timeout_ms / 1000
    while _in_flight(stage) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    remaining = _in_flight(stage)
    if remaining and body.get("force") is True:
        # Off the loop: closing waits for the engine's current step, and the loop meanwhile
        # sends each interrupted request's `closed` frame.
        await asyncio.to_thread(stage.close)
    return JSONResponse({"drained": remaining == 0, "in_flight": remaining, "pid": os.getpid()})


async def events(request: Request) -> Response:
    stage = request.app.state.stage

    async def lines() -> AsyncIterator[bytes]:
        last: dict[str, Any] | None = None
        while True:
            figures = _memory(stage)
            if figures != last:
                yield (json.dumps({"type": "worker.memory", **figures}) + "\n").encode()
                last = figures
            await asyncio.sleep(EVENTS_INTERVAL_S)

    return StreamingResponse(lines(), media_type="application/x-ndjson")


async def memory_complete(request: Request) -> Response:
    try:
        body = await read_json_object(request)
        inferences = _memory_requests(body)
    except RequestError as error:
        return openai_error(error.status, error.body)
    stage: InferenceStage = request.app.state.stage
    try:
        admitted = [await stage.admit(inference) for inference in inferences]
        results = await asyncio.gather(*(a.run() for a in admitted))
    except RequestError as error:
        return openai_error(error.status, error.body)
    return JSONResponse({"outputs": [result.text for result in results]})


async def take_response(request: Request) -> Response:
    try:
        body = await read_json_object(request)
    except RequestError as error:
        return openai_error(error.status, error.body)
    store: ResponseStore = request.app.state.response_store
    taken = store.take(str(body.get("id")))
    if taken is None:
        return openai_error(404, {"message": "no such stored response", "code": "not_found"})
    return JSONResponse(taken.to_json())


def _memory_requests(body: dict[str, Any]) -> list[InferenceRequest]:
    if body.get("call") not in ("complete", "completeBatch"):
        raise InvalidRequest("call must be 'complete' or 'completeBatch'", param="call")
    items = body.get("requests")
    if not isinstance(items, list) or not 1 <= len(items) <= MAX_MEMORY_REQUESTS:
        raise InvalidRequest(f"requests must be 1..{MAX_MEMORY_REQUESTS} items", param="requests")
    inferences = []
    for index, item in enumerate(items):
        given = item.get("input") if isinstance(item, dict) else None
        user = given.get("user") if isinstance(given, dict) else None
        if not isinstance(user, str):
            raise InvalidRequest(f"requests[{index}].input.user must be a string", "requests")
        system = given.get("system") if isinstance(given, dict) else None
        max_tokens = item.get("maxTokens", 256)
        if type(max_tokens) is not int or max_tokens < 1:
            raise InvalidRequest(f"requests[{index}].maxTokens must be >= 1", param="requests")
        messages = ([{"role": "system", "content": system}] if isinstance(system, str) else []) + [
            {"role": "user", "content": user}
        ]
        prompt = ChatPrompt(messages=tuple(messages))
        inferences.append(InferenceRequest(new_id("mem"), "chat", prompt, max_tokens=max_tokens))
    return inferences


def _in_flight(stage: Any) -> int:
    in_flight = getattr(stage, "in_flight", None)
    return int(in_flight()) if in_flight is not None else 0


def _memory(stage: Any) -> dict[str, Any]:
    figures: dict[str, Any] = {"pid": os.getpid(), "resident_bytes": stage.resident_bytes()}
    if isinstance(stage, InferenceStage):
        batch = stage.stats().batch
        figures.update(running=batch.active_rows, waiting=batch.pending_rows)
    return figures


async def give_back(request: Request) -> Response:
    stage = request.app.state.stage
    give_back_now = getattr(stage, "give_back_idle_memory", None)  # a companion has no pool
    given_back = bool(await asyncio.to_thread(give_back_now)) if give_back_now else False
    return JSONResponse({"given_back": given_back, "resident_bytes": stage.resident_bytes()})


async def adapters(request: Request) -> Response:
    held = getattr(request.app.state.stage, "adapters", None)
    if request.method == "GET":
        return JSONResponse({"adapters": adapter_state(held) if held is not None else {}})
    try:
        body = await read_json_object(request)
    except RequestError as error:
        return openai_error(error.status, error.body)
    order = {key: body[key] for key in ("op", "name", "path") if isinstance(body.get(key), str)}
    if held is None or "name" not in order:
        return openai_error(400, {"message": "this model takes no LoRA adapters"})
    if order.get("op") == "load" and "path" not in order:
        return openai_error(400, {"message": "path must be the adapter's files"})
    answer = await adapter_order(held, order)
    return answer if isinstance(answer, Response) else JSONResponse(answer)


WORKER_ROUTES = (
    ("GET", "/admin/adapters", adapters),
    ("POST", "/admin/adapters", adapters),
    ("POST", "/admin/drain", drain),
    ("POST", "/admin/give-back", give_back),
    ("GET", "/admin/events", events),
    ("POST", "/admin/memory/complete", memory_complete),
    ("POST", "/admin/responses/take", take_response),
)
