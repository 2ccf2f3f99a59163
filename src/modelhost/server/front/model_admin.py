"""Operator routes over residency: load, unload, pin and unpin a model, switch the current one,
and see the processes that serve them.

`POST /api/models/{id}/load|unload|pin|unpin`, `POST /api/hub/serve {model}`, `GET /engine`.
Refusals use the residency mapping (502 model_load_failed, 503 server_closing, 400 otherwise) in
OpenAI's shape; `unload` refuses a model that is answering a request unless `?force=1`.
"""

from __future__ import annotations

import os
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from modelhost.inference.contracts import RequestError
from modelhost.residency.router import ModelRouter
from modelhost.residency.unit import ResidencyError
from modelhost.server.front.leasing import residency_status
from modelhost.server.http import read_json_object
from modelhost.server.openai.wire import openai_error


async def model_action(request: Request) -> Response:
    router: ModelRouter[Any] = request.app.state.router
    model_id, action = request.path_params["model_id"], request.path_params["action"]
    if router.registry.get(model_id) is None:
        body = {"message": f"model '{model_id}' is not a local model", "code": "model_not_found"}
        return openai_error(404, {**body, "type": "invalid_request_error"})
    try:
        if action == "load":
            async with await router.acquire(model_id):
                pass
        elif action == "unload":
            force = request.query_params.get("force") in ("1", "true")
            flushed = await router.host.unload(model_id, force=force)
            return JSONResponse({"id": model_id, "resident": False, "flushed": flushed})
        elif action in ("pin", "unpin"):
            if action == "pin":  # a pinned model is resident: load it first when it is not
                async with await router.acquire(model_id):
                    router.host.pin(model_id)
            else:
                router.host.unpin(model_id)
        else:
            return openai_error(404, {"message": f"unknown action '{action}'"})
    except ResidencyError as error:
        return openai_error(*residency_status(error))
    pinned = any(m.pinned for m in router.host.resident() if m.id == model_id)
    resident = router.host.peek(model_id) is not None
    return JSONResponse({"id": model_id, "resident": resident, "pinned": pinned})


async def hub_serve(request: Request) -> Response:
    """Make the body's `model` current (loading it first)."""
    router: ModelRouter[Any] = request.app.state.router
    try:
        body = await read_json_object(request)
    except RequestError as error:
        return openai_error(error.status, error.body)
    model_id = body.get("model")
    if not isinstance(model_id, str):
        return openai_error(400, {"message": "`model` must be a local model id", "param": "model"})
    try:
        await router.serve(model_id)
    except ResidencyError as error:
        return openai_error(*residency_status(error))
    return JSONResponse({"current": router.current})


async def engine(request: Request) -> Response:
    """How models are served: each resident one's worker process (or this process), and the
    spare worker kept warm for the next load (`spare`: null when none is kept), and the fork
    server new workers are forked from (`fork_server`: null when there is none)."""
    router: ModelRouter[Any] = request.app.state.router
    workers = []
    for model in router.host.resident():
        unit = router.host.peek(model.id)
        worker = getattr(unit, "worker", None)
        row: dict[str, Any] = {"id": model.id, "role": model.role, "state": model.state}
        if model.node is not None:  # a cluster's: each replica on its node
            row["node"] = model.node
            unit = router.host.peek_on(model.id, model.node)
            worker = getattr(unit, "worker", None)
        if worker is not None:
            row.update(pid=worker.pid, worker_state=worker.state, restarts=worker.restarts)
            row["socket"] = worker.socket_path if worker.directory is not None else None
            row["from_spare"] = bool(getattr(worker, "from_spare", False))
            row["forked"] = bool(getattr(worker, "forked", False))
            row["startup"] = getattr(unit, "startup", None) or None
        else:
            row.update(pid=os.getpid(), restarts=0)
        workers.append(row)
    mode = getattr(request.app.state, "serving_mode", "in-process")  # set by `modelhost serve`
    spares = getattr(request.app.state, "spare_workers", None)  # None: no spare kept
    spare = spares.view() if spares is not None else None
    forks = getattr(request.app.state, "fork_server", None)  # None: no fork server
    fork_server = forks.view() if forks is not None else None
    return JSONResponse({"mode": mode, "current": router.current, "workers": workers,
                         "spare": spare, "fork_server": fork_server})  # fmt: skip


ADMIN_ROUTES = (
    ("GET", "/engine", engine),
    ("POST", "/api/models/{model_id:path}/{action}", model_action),
    ("POST", "/api/hub/serve", hub_serve),
)
