"""`modelhost serve`: load one model, start its engine, and serve the OpenAI surfaces over HTTP.

The CLI wires `add_serve_parser(subparsers)` (modelhost.cli_serve_args) and calls
`run_serve(args)`; tests and embedders use `build_serving(...)` +
`modelhost.server.http_server.serve(app, ...)`, or `build_app` directly.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import sqlite3
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from modelhost.cli_progress import ProgressBar, load_reporter
from modelhost.inference.admission import BYTES_PER_GB, BudgetTooSmall
from modelhost.models.embedded import DEFAULT_MODEL
from modelhost.residency.host import ResidencyHost
from modelhost.residency.registry import ModelEntry, ModelRegistry
from modelhost.residency.router import ModelRouter
from modelhost.residency.unit import LoadProgress, ResidencyError
from modelhost.serve_config import (
    available_memory_bytes,
    default_budget_bytes,
    quantize_mode,
    serving_shape,
    settings_from_args,
)
from modelhost.server.app import admission_policy, create_app, create_routed_app
from modelhost.server.http_server import serve
from modelhost.server.prometheus import SampleSource, WorkerSamples
from modelhost.server.settings import ServeSettings

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from modelhost.inference.stage import InferenceStage
    from modelhost.models.loaded import LoadedModel


def build_stage(
    model: LoadedModel, settings: ServeSettings, *, batch: int = 8, max_queue: int = 64
) -> InferenceStage:
    """The engine over `model` (its KV pool sized by the memory budget) and its stage.

    Raises BudgetTooSmall when --memory-budget cannot hold the weights and any context.
    """
    from modelhost.engine.engine import Engine, EngineConfig
    from modelhost.engine.speculation import speculate_mode
    from modelhost.inference.stage import InferenceStage

    policy = admission_policy(model, settings, rows=batch)
    config = EngineConfig(
        batch=batch,
        max_queue=max_queue,
        kv_cache_bytes=policy.memory.kv_bytes if policy.memory is not None else None,
        max_num_batched_tokens=settings.chunk_tokens,
        context_length=settings.context_length,
        prompt_threads=settings.prompt_threads,
        speculate=speculate_mode(settings.speculate),
    )
    return InferenceStage(Engine(model, config), model, policy=policy, defaults=settings.defaults)


def build_serving(
    model: LoadedModel, settings: ServeSettings, *, batch: int = 8, max_queue: int = 64
) -> Starlette:
    """One model's server, without residency (tests and embedders)."""
    stage = build_stage(model, settings, batch=batch, max_queue=max_queue)
    try:
        return create_app(stage, settings)
    except BaseException:
        stage.close()
        raise


def run_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    settings = settings_from_args(args)
    if getattr(args, "cluster", None):  # the only path that imports Ray
        from modelhost.cluster.serve import run_cluster

        return run_cluster(args, settings)
    names = list(args.models) or [DEFAULT_MODEL]
    registry = ModelRegistry(shape=serving_shape(args, settings))
    entries = [registry.resolve_argument(name) for name in names]
    for name, entry in zip(names, entries, strict=True):
        if entry is None:
            print(
                f"modelhost serve: model '{name}' not found (see `modelhost ls`)", file=sys.stderr
            )
            return 2
    startup = entries[0]
    assert startup is not None
    if startup.refusal is not None:
        print(f"modelhost serve: {startup.id} cannot be served: {startup.refusal}", file=sys.stderr)
        return 2
    if getattr(args, "workers", False):
        return _run_workers(args, settings, registry, startup)
    # In-process: the engines run here (a worker-mode front never imports PyTorch).
    from modelhost.engine.engine import set_threads, share_the_gil_with_the_engine
    from modelhost.models import loader
    from modelhost.residency.inprocess import InProcessUnit, in_process_loader

    set_threads(getattr(args, "threads", None))
    quantize = quantize_mode(args)
    # Before listening: a bad model ends the server here.
    model = loader.load_model(
        str(startup.path), quantize=quantize, progress=load_reporter(startup.id)
    )
    model.id = startup.id
    share_the_gil_with_the_engine()  # engines run in this process

    def stage_for(loaded: LoadedModel) -> InferenceStage:
        return build_stage(loaded, settings, batch=args.batch, max_queue=args.max_queue)

    try:
        unit = InProcessUnit(stage_for(model), model.load_seconds * 1000)
    except BudgetTooSmall as exc:
        print(f"modelhost serve: {exc}", file=sys.stderr)
        return 2

    async def adopt_startup_model(host: ResidencyHost[InProcessUnit]) -> None:
        host.adopt(startup, unit, load_ms=unit.load_ms)

    load = in_process_loader(functools.partial(loader.load_model, quantize=quantize), stage_for)
    return _serve_routed(args, settings, registry, startup, load, adopt_startup_model, "")


def _run_workers(
    args: argparse.Namespace, settings: ServeSettings, registry: ModelRegistry, startup: ModelEntry
) -> int:
    """`--workers`: every resident model in its own process; the startup model loads first."""
    from modelhost.cli_worker import worker_loader
    from modelhost.residency.worker_unit import WorkerUnit

    async def load_startup_model(host: ResidencyHost[WorkerUnit]) -> None:
        shown = asyncio.create_task(show_load(host, startup.id))
        try:
            async with await host.acquire(startup.id):
                pass
        except ResidencyError as exc:  # before listening: a bad model ends the server here
            print(f"modelhost serve: {exc.message}", file=sys.stderr)
            raise
        finally:
            shown.cancel()

    samples = WorkerSamples()  # the workers' request series, for the front's /metrics
    load = worker_loader(
        settings,
        batch=args.batch,
        max_queue=args.max_queue,
        log_level=args.log_level,
        env=samples.env(),
        quantize=quantize_mode(args),
        threads=getattr(args, "threads", None),
    )
    return _serve_routed(
        args, settings, registry, startup, load, load_startup_model, ", worker processes", samples
    )


async def show_load(host: ResidencyHost[Any], model_id: str) -> None:
    """Draws the startup model's load as a bar on a terminal (a worker reports its progress
    to the host); elsewhere the host's own lines for each tenth say it."""
    report = load_reporter(model_id)
    if not isinstance(report, ProgressBar):
        return
    models_log = logging.getLogger("modelhost.models")
    models_log.addFilter(_without_progress_lines)
    try:
        while True:
            for model in host.resident():
                if model.id == model_id and model.progress is not None:
                    report(model.progress)
            await asyncio.sleep(0.2)
    finally:
        models_log.removeFilter(_without_progress_lines)


def _without_progress_lines(record: logging.LogRecord) -> bool:
    return record.msg != LoadProgress.LOG_MESSAGE


async def pin_companion(router: ModelRouter[Any], need: str) -> None:
    """Load the first local model that does `need` and pin it (`--whisper-resident`)."""
    model_id = router.route(None, need)
    async with await router.acquire(model_id):
        router.host.pin(model_id)


def _serve_routed(
    args: argparse.Namespace,
    settings: ServeSettings,
    registry: ModelRegistry,
    startup: ModelEntry,
    load: Any,
    start: Callable[[ResidencyHost[Any]], Awaitable[None]],
    mode: str,
    worker_samples: WorkerSamples | None = None,
) -> int:
    """Host, router and app over `load`; `start` brings the startup model in before listening."""
    budget_gb = args.model_budget
    host: ResidencyHost[Any] = ResidencyHost(
        budget_bytes=int(budget_gb * BYTES_PER_GB) if budget_gb else default_budget_bytes(),
        source=registry.get,
        load=load,
        hold_s=args.hold,
        available=available_memory_bytes,
    )
    router = ModelRouter(host, registry, current=startup.id)
    return serve_router(args, settings, router, start, mode, worker_samples)


def serve_router(
    args: argparse.Namespace,
    settings: ServeSettings,
    router: ModelRouter[Any],
    start: Callable[[Any], Awaitable[None]],
    mode: str,
    worker_samples: SampleSource | None = None,
) -> int:
    """The app over `router`, served until a signal; `start(host)` runs before listening."""
    host = router.host
    startup_id = router.current

    async def start_all() -> None:
        try:  # opening the job store marks jobs a previous server left running as zombies
            app.state.jobs.store  # noqa: B018
        except (OSError, sqlite3.Error) as exc:  # a read-only home: serve models, not jobs
            logging.getLogger(__name__).warning("the job store is unavailable: %s", exc)
        await start(host)
        if getattr(args, "whisper_resident", False):
            await pin_companion(router, "transcribe")

    app = create_routed_app(router, settings, start_all, worker_samples=worker_samples)
    app.state.serving_mode = "cluster" if "cluster" in mode else "workers" if mode else "in-process"
    budget_text = f"{host.budget_bytes / BYTES_PER_GB:.1f} GB model budget{mode}"
    if "cluster" in mode:  # its nodes and their budgets join once it starts
        budget_text = mode.removeprefix(", ")
    print(f"modelhost: serving {startup_id} on http://{args.host}:{args.port}/v1 ({budget_text})",
          file=sys.stderr)  # fmt: skip
    if settings.console:
        print(f"modelhost: console on http://{args.host}:{args.port}/", file=sys.stderr)
    started = serve(
        app,
        host=args.host,
        port=args.port,
        shutdown_timeout_s=args.shutdown_timeout,
        log_level=args.log_level,
    )
    return 0 if started else 2
