"""`modelhost serve`: find the models, bring the first one in, and serve every surface over HTTP.

The CLI wires `add_serve_parser(subparsers)` (cli/serve_args.py) and calls `run_serve(args)`;
what it serves is built by `modelhost.assembly` (in-process, with worker processes, or as a
cluster's front).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import logging
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modelhost.assembly import (
    build_stage,
    serve_cluster,
    serve_router,
    worker_loader,
)
from modelhost.cli.progress import ProgressBar, load_reporter
from modelhost.cli.serve_early import EarlyStart, start_worker_processes
from modelhost.inference.admission import BYTES_PER_GB, BudgetTooSmall
from modelhost.models.loading.embedded import DEFAULT_MODEL
from modelhost.residency.adapter_catalog import AdapterCatalog, parse_adapter_argument
from modelhost.residency.host import ResidencyHost
from modelhost.residency.registry import ModelEntry, ModelRegistry, with_draft
from modelhost.residency.router import ModelRouter
from modelhost.residency.unit import LoadProgress, ResidencyError
from modelhost.residency.workers.forks import ForkServerHandle
from modelhost.residency.workers.memory_reading import LastReading
from modelhost.serve_config import (
    WORKER_MODULE,
    available_memory_bytes,
    default_budget_bytes,
    quantize_mode,
    serving_shape,
    settings_from_args,
)
from modelhost.server.observability.prometheus import WorkerSamples
from modelhost.server.settings import ServeSettings

if TYPE_CHECKING:
    from modelhost.inference.stage import InferenceStage
    from modelhost.models.loaded import LoadedModel
    from modelhost.residency.workers.spare_pool import SpareWorkers


def run_serve(args: argparse.Namespace, started: EarlyStart | None = None) -> int:
    """Serve until a signal; `started`: what `start_worker_processes(args)` started already
    (the CLI does, before importing this module), else it starts now. The workers' request
    series (for the front's /metrics) and the fork server end with the server."""
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    samples, forks = started if started is not None else start_worker_processes(args)
    try:
        return _run_serve(args, samples, forks)
    finally:
        if forks is not None:  # after the workers it forked: the app has stopped them
            forks.close()
        if samples is not None:
            samples.close()


def _run_serve(
    args: argparse.Namespace, samples: WorkerSamples | None, forks: ForkServerHandle | None
) -> int:
    settings = settings_from_args(args)
    if getattr(args, "cluster", None):  # the only path that imports Ray
        refused = cluster_refusal(args)
        if refused is not None:
            print(f"modelhost serve: {refused}", file=sys.stderr)
            return 2
        return serve_cluster(args, settings)
    names = list(args.models) or [DEFAULT_MODEL]
    registry = ModelRegistry(shape=serving_shape(args, settings))
    mmproj = getattr(args, "mmproj", None)
    try:  # --mmproj goes with the first model
        entries = [
            registry.resolve_argument(name, Path(mmproj) if mmproj and i == 0 else None)
            for i, name in enumerate(names)
        ]
    except ValueError as exc:
        print(f"modelhost serve: {exc}", file=sys.stderr)
        return 2
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
    try:
        settings = with_draft_model(args, settings, registry)
        adapters = [parse_adapter_argument(value) for value in getattr(args, "adapter", [])]
    except ValueError as exc:
        print(f"modelhost serve: {exc}", file=sys.stderr)
        return 2
    # Adapters adapt the first model; their weights are checked against it when it loads.
    settings = dataclasses.replace(
        settings, adapters=tuple((name, startup.id, path) for name, path in adapters)
    )
    catalog = AdapterCatalog(settings.adapters)
    if samples is not None:  # --workers
        return _run_workers(args, settings, registry, startup, samples, forks, catalog)
    # In-process: the engines run here (a worker-mode front never imports PyTorch).
    from modelhost.engine.draft_model import DraftMismatch
    from modelhost.engine.engine import set_threads, share_the_gil_with_the_engine
    from modelhost.models.adapters.refusals import AdapterRefused
    from modelhost.models.loading import loader
    from modelhost.residency.inprocess import InProcessUnit, in_process_loader

    set_threads(getattr(args, "threads", None))
    quantize = quantize_mode(args)
    # Before listening: a bad model ends the server here.
    model = loader.load_model(
        str(startup.path),
        quantize=quantize,
        progress=load_reporter(startup.id),
        mmproj=startup.mmproj,
    )
    model.id = startup.id
    share_the_gil_with_the_engine()  # engines run in this process

    def stage_for(loaded: LoadedModel) -> InferenceStage:
        own = dataclasses.replace(settings, adapters=catalog.for_base(loaded.id))
        return build_stage(
            loaded, own, batch=args.batch, max_queue=args.max_queue, quantize=quantize
        )

    try:
        unit = InProcessUnit(stage_for(model), model.load_seconds * 1000)
    except (BudgetTooSmall, DraftMismatch, AdapterRefused) as exc:
        print(f"modelhost serve: {exc}", file=sys.stderr)
        return 2

    async def adopt_startup_model(host: ResidencyHost[InProcessUnit]) -> None:
        host.adopt(startup, unit, load_ms=unit.load_ms)

    load = in_process_loader(functools.partial(loader.load_model, quantize=quantize), stage_for)
    return _serve_routed(
        args, settings, registry, startup, load, adopt_startup_model, "", catalog=catalog
    )


def _run_workers(
    args: argparse.Namespace,
    settings: ServeSettings,
    registry: ModelRegistry,
    startup: ModelEntry,
    samples: WorkerSamples,
    forks: ForkServerHandle | None,
    catalog: AdapterCatalog,
) -> int:
    """`--workers`: every resident model in its own process (forked by `forks` where it runs);
    the startup model loads first."""
    from modelhost.residency.workers.spare_pool import SpareWorkers
    from modelhost.residency.workers.worker_unit import WorkerUnit

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

    wanted = getattr(args, "spare_worker", True)
    spares = SpareWorkers(WORKER_MODULE, env=samples.env(), forks=forks) if wanted else None
    load = worker_loader(
        settings,
        batch=args.batch,
        max_queue=args.max_queue,
        log_level=args.log_level,
        env=samples.env(),
        quantize=quantize_mode(args),
        threads=getattr(args, "threads", None),
        spares=spares,
        forks=forks,
        adapters=catalog,
    )
    return _serve_routed(
        args, settings, registry, startup, load, load_startup_model, ", worker processes", samples,
        spares, forks, catalog,
    )  # fmt: skip


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


def cluster_refusal(args: argparse.Namespace) -> str | None:
    """Why `--cluster` cannot serve these flags, or None. A draft model is not placed on a
    cluster's nodes (each node would need its file and room for it in its budget): refused
    before joining, rather than served without guesses."""
    if getattr(args, "draft_model", None) is not None:
        return "--draft-model is not available with --cluster (serve it on one machine)"
    if getattr(args, "adapter", None):
        return "--adapter is not available with --cluster (serve adapters on one machine)"
    if getattr(args, "speculate", "auto") == "draft":
        return "--speculate draft needs --draft-model, which --cluster does not serve"
    return None


def with_draft_model(
    args: argparse.Namespace, settings: ServeSettings, registry: ModelRegistry
) -> ServeSettings:
    """`settings` with --draft-model resolved to its id and path (ValueError: not found, or
    --speculate draft without one)."""
    name = getattr(args, "draft_model", None)
    if name is None:
        if settings.speculate == "draft":
            raise ValueError("--speculate draft needs --draft-model ID")
        return settings
    entry = registry.resolve_argument(name)
    if entry is None or "generate" not in entry.operations or entry.refusal is not None:
        raise ValueError(f"draft model '{name}' not found among the local generative models")
    return dataclasses.replace(settings, draft_model_id=entry.id, draft_model_path=str(entry.path))


def paired(registry: ModelRegistry, draft: ModelEntry, model_id: str) -> ModelEntry | None:
    """A model's entry as the host budgets it: with the draft model's memory beside it."""
    entry = registry.get(model_id)
    if entry is None or entry.id == draft.id or "generate" not in entry.operations:
        return entry
    return with_draft(entry, draft)


def _without_progress_lines(record: logging.LogRecord) -> bool:
    return record.msg != LoadProgress.LOG_MESSAGE


def _serve_routed(
    args: argparse.Namespace,
    settings: ServeSettings,
    registry: ModelRegistry,
    startup: ModelEntry,
    load: Any,
    start: Callable[[ResidencyHost[Any]], Awaitable[None]],
    mode: str,
    worker_samples: WorkerSamples | None = None,
    spares: SpareWorkers | None = None,
    forks: ForkServerHandle | None = None,
    catalog: AdapterCatalog | None = None,
) -> int:
    """Host, router and app over `load`; `start` brings the startup model in before listening.
    A spare worker's memory and the fork server's count against the budget beside the models'."""
    budget_gb = args.model_budget
    draft = registry.get(settings.draft_model_id) if settings.draft_model_id else None
    beside = LastReading(functools.partial(held_beside_models, spares, forks))
    host: ResidencyHost[Any] = ResidencyHost(
        budget_bytes=int(budget_gb * BYTES_PER_GB) if budget_gb else default_budget_bytes(),
        source=registry.get if draft is None else functools.partial(paired, registry, draft),
        load=load,
        external=lambda: beside.last() or 0,  # read in the background (memory_reading.py)
        hold_s=args.hold,
        available=available_memory_bytes,
    )
    if spares is not None:  # the next spare waits for the model just loaded to answer
        spares.follow(host)
    if forks is not None:  # a model loaded again parses its tokenizer no more
        forks.follow(host, lambda model_id: getattr(registry.get(model_id), "path", None))
    router = ModelRouter(host, registry, current=startup.id, adapters=catalog)
    return serve_router(args, settings, router, start, mode, worker_samples, spares, forks)


def held_beside_models(spares: SpareWorkers | None, forks: ForkServerHandle | None) -> int:
    """The memory of the processes kept for the next load: the spare and the fork server."""
    return (spares.held_bytes() if spares else 0) + (forks.held_bytes() if forks else 0)
