"""The ASGI application: the route table, and the lifespan that closes the engine."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp

from modelhost.residency.router import ModelRouter
from modelhost.server.edge.access import edge
from modelhost.server.edge.json_logs import use_json_logs
from modelhost.server.front.adapter_admin import ADAPTER_ROUTES
from modelhost.server.front.kv_admin import KV_ROUTES
from modelhost.server.front.leasing import ModelLeasing
from modelhost.server.front.model_admin import ADMIN_ROUTES
from modelhost.server.front.worker_admin import WORKER_ROUTES
from modelhost.server.job_routes import install_jobs, with_jobs
from modelhost.server.observability.console import install_console, worker_requests
from modelhost.server.observability.live_feed import LiveFeed
from modelhost.server.observability.prometheus import Metrics, SampleSource, metrics_endpoint
from modelhost.server.responses.store import ResponseStore
from modelhost.server.settings import ServeSettings
from modelhost.server.surfaces import SURFACES, Surfaces

if TYPE_CHECKING:
    from modelhost.inference.stage import InferenceStage
    from modelhost.residency.workers.spare_pool import SpareWorkers


def create_app(
    stage: InferenceStage, settings: ServeSettings, surfaces: Surfaces = SURFACES
) -> Starlette:
    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        if settings.close_engine_on_shutdown:
            stage.close()

    app = _new_app(settings, lifespan, surfaces)
    app.state.stage = stage
    app.state.drain = stage.close  # the HTTP server ends in-flight requests so at its deadline
    if settings.owner == "worker":  # served on the worker's private socket only
        for method, path, endpoint in WORKER_ROUTES:
            app.router.add_route(path, endpoint, methods=[method])
        app.router.add_route("/admin/requests", worker_requests, methods=["GET"])
    return app


def create_routed_app(
    router: ModelRouter[Any],
    settings: ServeSettings,
    startup: Callable[[], Awaitable[None]] | None = None,
    surfaces: Surfaces = SURFACES,
    worker_samples: SampleSource | None = None,
    spare_workers: SpareWorkers | None = None,
) -> Starlette:
    """The server for every local model behind one port, routed by the body's `model`.
    `startup` runs before the listener binds (it loads the startup model); `worker_samples`
    is where worker processes write their request series (the app closes it);
    `spare_workers` keeps a warm worker from then on (the app stops it)."""

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if startup is not None:
            await startup()
        try:
            if spare_workers is not None:  # after the startup model: never beside its load
                spare_workers.start()
            yield
        finally:
            try:
                if spare_workers is not None:  # first: none is wanted while models drain
                    await spare_workers.close()
            finally:
                try:
                    await router.close()
                finally:
                    if worker_samples is not None:
                        worker_samples.close()

    app = _new_app(settings, lifespan, surfaces, worker_samples)
    app.state.stage = None
    app.state.router = router
    app.state.spare_workers = spare_workers
    app.state.metrics.watch_residency(router.host)
    app.state.drain = router.interrupt_all
    for method, path, endpoint in (*ADMIN_ROUTES, *KV_ROUTES, *ADAPTER_ROUTES):
        app.router.add_route(path, endpoint, methods=[method])
    app.add_middleware(ModelLeasing, router=router, surfaces=surfaces)
    return app


def _new_app(
    settings: ServeSettings,
    lifespan: Any,
    surfaces: Surfaces,
    worker_samples: SampleSource | None = None,
) -> Starlette:
    serves_jobs = settings.owner != "worker"  # a worker process serves its model, nothing else
    if serves_jobs:
        lifespan = with_jobs(lifespan)
    app = _ModelhostApp(lifespan=lifespan)
    app.state.settings = settings
    app.state.surfaces = surfaces
    app.state.metrics = Metrics(app.state, worker_samples)
    app.state.live = LiveFeed()  # the console's live view: requests in flight and just ended
    app.state.request_observers = [app.state.live]  # told of each request by the edge
    app.router.add_route("/metrics", metrics_endpoint, methods=["GET"])
    if settings.log_format == "json":
        use_json_logs()
    app.state.response_store = ResponseStore()
    for route in surfaces.routes():
        # Starlette calls whatever an endpoint returns as an ASGI app: an EventStreamResponse
        # is one, though not a Response.
        endpoint: Any = route.endpoint
        app.router.add_route(route.path, endpoint, methods=[route.method])
    if serves_jobs:
        install_jobs(app)
        install_console(app)
    app.add_exception_handler(HTTPException, _http_error)
    return app


class _ModelhostApp(Starlette):
    """Starlette with modelhost's edge (request ids, access guard, API key, body limits) around
    its whole middleware stack, model routing included: see `server/edge/access.py`."""

    def build_middleware_stack(self) -> ASGIApp:
        state = self.state
        stack = super().build_middleware_stack()
        observers = state.request_observers
        return edge(stack, state.settings, state.metrics, state.surfaces, observers)


async def _http_error(request: Request, exc: Exception) -> Response:
    """Unknown routes and methods answer in the error shape of the surface the path is near
    (a wrong method on `/api/chat` in Ollama's), OpenAI's elsewhere."""
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    message = f"{request.method} {request.url.path}: {getattr(exc, 'detail', 'error')}"
    errors = request.app.state.surfaces.errors_for(request.url.path)
    return errors.response(status, {"message": message, "type": "invalid_request_error"})
