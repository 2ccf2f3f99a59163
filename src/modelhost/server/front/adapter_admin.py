"""Operator routes over LoRA adapters, at run time: list, load and unload.

- `GET /api/adapters`: every adapter, its base model and its files; for a resident base, its
  loaded adapters' bytes and the requests running with each.
- `POST /api/adapters {name, path, model?}`: load the adapter at `path` (a PEFT folder or a
  llama.cpp GGUF LoRA file) for `model` (default: the current model), which is loaded first
  when it is not resident; requests may then name it. 400 `adapter_refused` when it does not
  fit the base (another base's shapes, projections that cannot be patched), 404
  `model_not_found` for a base that is not local.
- `DELETE /api/adapters/{name}`: forget it; requests running with it finish with it.

The base's unit holds the weights: an in-process stage's adapter set, or a worker's, through
its private `/admin/adapters` (server/front/worker_admin.py). The catalog (the router's) is
what a base's unit is told again when it comes back after an eviction.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from modelhost.inference.contracts import RequestError
from modelhost.residency.adapter_catalog import AdapterEntry, adapter_path
from modelhost.residency.router import ModelRouter
from modelhost.residency.unit import ResidencyError
from modelhost.residency.workers.worker_unit import WorkerUnit
from modelhost.server.front.leasing import residency_status
from modelhost.server.http import read_json_object
from modelhost.server.openai.wire import openai_error


def _invalid(message: str, param: str, code: str | None = None) -> Response:
    body = {"message": message, "type": "invalid_request_error", "param": param, "code": code}
    return openai_error(400, body)


async def list_adapters(request: Request) -> Response:
    router: ModelRouter[Any] = request.app.state.router
    rows = []
    for entry in router.adapters.entries():
        row: dict[str, Any] = {"name": entry.name, "model": entry.base, "path": entry.path}
        held = await _unit_adapters(router.host.peek(entry.base))
        row.update(held.get(entry.name, {"loaded": False}))
        rows.append(row)
    return JSONResponse({"object": "list", "data": rows})


async def load_adapter(request: Request) -> Response:
    router: ModelRouter[Any] = request.app.state.router
    try:
        body = await read_json_object(request)
    except RequestError as error:
        return openai_error(error.status, error.body)
    name, path, base = body.get("name"), body.get("path"), body.get("model", router.current)
    if not isinstance(name, str) or not name or name == "none":
        return _invalid("`name` must be the adapter's name (not 'none')", "name")
    if router.registry.get(name) is not None:
        return _invalid(f"'{name}' is a local model's id: name the adapter otherwise", "name")
    if not isinstance(path, str):
        return _invalid("`path` must be the adapter's folder or GGUF file", "path")
    try:
        resolved = str(adapter_path(path))
    except ValueError as exc:
        return _invalid(str(exc), "path")
    if not isinstance(base, str) or router.registry.get(base) is None:
        body = {"message": f"model '{base}' is not a local model", "code": "model_not_found"}
        return openai_error(404, {**body, "type": "invalid_request_error", "param": "model"})
    try:
        async with await router.acquire(base) as lease:
            answer = await _tell_unit(lease.unit, {"op": "load", "name": name, "path": resolved})
    except ResidencyError as error:
        return openai_error(*residency_status(error))
    if isinstance(answer, Response):
        return answer
    router.adapters.add(AdapterEntry(name, base, resolved))
    return JSONResponse({"name": name, "model": base, "path": resolved, **answer})


async def unload_adapter(request: Request) -> Response:
    router: ModelRouter[Any] = request.app.state.router
    name = request.path_params["name"]
    entry = router.adapters.remove(name)
    if entry is None:
        message = f"The adapter '{name}' does not exist"
        body = {"message": message, "type": "invalid_request_error", "code": "model_not_found"}
        return openai_error(404, {**body, "param": "name"})
    unit = router.host.peek(entry.base)
    if unit is not None:
        await _tell_unit(unit, {"op": "unload", "name": name})
    return JSONResponse({"name": name, "model": entry.base, "removed": True})


async def _tell_unit(unit: Any, order: dict[str, str]) -> dict[str, Any] | Response:
    """Have the base's unit load or unload an adapter: its answer, or the refusal to relay."""
    if isinstance(unit, WorkerUnit):
        try:
            response = await unit.client().post("/admin/adapters", json=order, timeout=300.0)
        except httpx.HTTPError as exc:
            body = {"message": f"the model's worker did not answer: {exc}"}
            return openai_error(502, {**body, "type": "engine_unavailable"})
        answer = response.json()
        if response.status_code != 200:
            return openai_error(response.status_code, answer.get("error", answer))
        return dict(answer)
    stage = getattr(unit, "stage", None)
    adapters = getattr(stage, "adapters", None)
    if adapters is None:
        return _invalid("this model takes no LoRA adapters", "model", "adapter_refused")
    return await adapter_order(adapters, order)


async def adapter_order(adapters: Any, order: dict[str, str]) -> dict[str, Any] | Response:
    """Carry out a load or unload on an adapter set (here, or in a worker)."""
    from modelhost.models.adapters.refusals import AdapterRefused, AdaptersBusy

    name = order["name"]
    if order.get("op") == "unload":
        return {"removed": adapters.remove(name)}
    try:
        adapter = await asyncio.to_thread(adapters.add, name, order["path"])
    except AdapterRefused as exc:
        return _invalid(str(exc), "path", "adapter_refused")
    except AdaptersBusy as exc:
        return openai_error(429, {"message": str(exc), "code": "adapters_busy"})
    return {"loaded": True, "bytes": adapter.nbytes}


async def _unit_adapters(unit: Any) -> dict[str, dict[str, Any]]:
    """A resident base's loaded adapters: bytes and running requests, by name."""
    if unit is None:
        return {}
    if isinstance(unit, WorkerUnit):
        answer = await unit.get_json("/admin/adapters")
        return dict(answer.get("adapters", {})) if answer is not None else {}
    adapters = getattr(getattr(unit, "stage", None), "adapters", None)
    return adapter_state(adapters) if adapters is not None else {}


def adapter_state(adapters: Any) -> dict[str, dict[str, Any]]:
    """What an adapter set holds, by name."""
    return {
        adapter.name: {"loaded": True, "bytes": adapter.nbytes, "running": adapters.in_use(name)}
        for name, adapter in ((a.name, a) for a in adapters.loaded())
    }


ADAPTER_ROUTES = (
    ("GET", "/api/adapters", list_adapters),
    ("POST", "/api/adapters", load_adapter),
    ("DELETE", "/api/adapters/{name:path}", unload_adapter),
)
