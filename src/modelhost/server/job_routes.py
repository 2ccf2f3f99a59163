"""Job routes: submit, list, read, follow (SSE) and cancel long-running jobs.

| route                           | answer                                                      |
| ------------------------------- | ----------------------------------------------------------- |
| `POST /api/jobs {kind, config}` | `{ok, job}`; 400 `{ok:false, error}` naming what is wrong   |
| `GET /api/jobs?limit=50&kind=`  | `{ok, jobs}`, newest first                                  |
| `GET /api/jobs/{id}`            | `{ok, job}`; 404 `{ok:false, error:"job not found"}`        |
| `GET /api/jobs/{id}/stream`     | SSE: history, live events, terminal event, `event: end`     |
| `POST /api/jobs/{id}/cancel`    | `{ok, job}` once it has ended; 409 when it already had      |

The job host is created with the app and closed at shutdown (its children killed); worker
processes serve models only and have none.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from modelhost.jobs.config import InvalidJob
from modelhost.jobs.kinds import JobContext
from modelhost.jobs.manager import JobManager
from modelhost.jobs.sse import job_frames
from modelhost.jobs.store import TERMINAL, JobStore
from modelhost.server.http import SSE_HEADERS

NOT_FOUND = "job not found"
Endpoint = Callable[[Request], Awaitable[Response]]


def _error(status: int, error: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"ok": False, "error": error, **extra}, status_code=status)


def _manager(request: Request) -> JobManager:
    manager: JobManager = request.app.state.jobs
    return manager


async def submit_job(request: Request) -> Response:
    try:
        body = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError):
        return _error(400, "invalid JSON body")
    if not isinstance(body, dict):
        return _error(400, "invalid JSON body")
    try:
        job = _manager(request).submit(body.get("kind"), body.get("config"))
    except InvalidJob as exc:
        return _error(400, str(exc))
    except RuntimeError as exc:  # the host is closing
        return _error(503, str(exc))
    return JSONResponse({"ok": True, "job": job})


async def list_jobs(request: Request) -> Response:
    raw_limit = request.query_params.get("limit", "50")
    try:
        limit = int(raw_limit)
    except ValueError:
        return _error(400, "limit must be an integer")
    kind = request.query_params.get("kind") or None
    return JSONResponse({"ok": True, "jobs": _manager(request).store.recent(limit, kind)})


async def get_job(request: Request) -> Response:
    job = _manager(request).store.get(request.path_params["job_id"])
    if job is None:
        return _error(404, NOT_FOUND)
    return JSONResponse({"ok": True, "job": job})


async def stream_job(request: Request) -> Response:
    manager = _manager(request)
    job_id = request.path_params["job_id"]
    if manager.store.get(job_id) is None:
        return _error(404, NOT_FOUND)
    heartbeat_s = request.app.state.settings.heartbeat_s
    frames = job_frames(manager.store, job_id, manager.changed, heartbeat_s=heartbeat_s)
    return StreamingResponse(frames, media_type="text/event-stream", headers=SSE_HEADERS)


async def cancel_job(request: Request) -> Response:
    manager = _manager(request)
    job_id = request.path_params["job_id"]
    job = manager.store.get(job_id)
    if job is None:
        return _error(404, NOT_FOUND)
    if job["status"] in TERMINAL or not await manager.cancel(job_id):
        return _error(409, "job already ended", job=manager.store.get(job_id))
    return JSONResponse({"ok": True, "job": manager.store.get(job_id)})


def _store_guarded(endpoint: Endpoint) -> Endpoint:
    """A job store that cannot be opened or written (a read-only or full MODELHOST_HOME) is a
    503 that says so; the models keep serving."""

    @functools.wraps(endpoint)
    async def guarded(request: Request) -> Response:
        try:
            return await endpoint(request)
        except (OSError, sqlite3.Error) as exc:
            return _error(503, f"the job store is unavailable: {exc}")

    return guarded


JOB_ROUTES = tuple(
    (method, path, _store_guarded(endpoint))
    for method, path, endpoint in (
        ("POST", "/api/jobs", submit_job),
        ("GET", "/api/jobs", list_jobs),
        ("GET", "/api/jobs/{job_id}", get_job),
        ("GET", "/api/jobs/{job_id}/stream", stream_job),
        ("POST", "/api/jobs/{job_id}/cancel", cancel_job),
    )
)


def _model_hold(app: Starlette) -> Any:
    """With several models, a job that drives one holds its lease for the whole run, so it
    is not evicted underneath the job; a single-model app has nothing to evict."""

    @contextlib.asynccontextmanager
    async def hold(config: dict[str, Any]) -> AsyncIterator[None]:
        router = getattr(app.state, "router", None)
        if router is None:
            yield
            return
        async with await router.acquire(router.route(config.get("model"))):
            yield

    return hold


def install_jobs(app: Starlette) -> None:
    """The job routes and the job host (its database opens on the first job route)."""
    for method, path, endpoint in JOB_ROUTES:
        app.router.add_route(path, endpoint, methods=[method])

    def context() -> JobContext:
        settings = getattr(app.state, "settings", None)
        return JobContext(
            base_url=getattr(app.state, "base_url", None),
            api_key=getattr(settings, "api_key", None),
        )

    app.state.jobs = JobManager(JobStore, context=context, hold=_model_hold(app))


def with_jobs(lifespan: Any) -> Any:
    """`lifespan`, then closing the job host: unfinished jobs fail, their children killed.
    Jobs end before the models they drive are closed."""

    @contextlib.asynccontextmanager
    async def both(app: Starlette) -> AsyncIterator[None]:
        async with lifespan(app):
            try:
                yield
            finally:
                await app.state.jobs.close()

    return both
