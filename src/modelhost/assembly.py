"""One place assembles a server: the stage over a model, the app over a stage or a router, the
worker launch, and the cluster's front. The command line (`cli/serve.py`), the worker entry
(`cli/worker.py`) and the cluster (`cluster/serve.py`, through `serve_cluster`) all build here,
so a server is built one way whichever process runs it.

Tests and embedders use `build_serving(...)` + `modelhost.server.http_server.serve(app, ...)`,
or `build_stage` under a residency host of their own.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import sqlite3
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modelhost.engine.kv.kv_format import kv_token_bytes, parse_kv_format
from modelhost.inference.admission import (
    BYTES_PER_GB,
    AdmissionPolicy,
    budget_window,
    plan_memory,
)
from modelhost.inference.contracts import Overflow
from modelhost.residency.adapter_catalog import AdapterCatalog
from modelhost.residency.registry import ModelEntry
from modelhost.residency.router import ModelRouter
from modelhost.residency.unit import LoadProgress
from modelhost.residency.workers.supervisor import MAX_RESTARTS, WorkerFailed, WorkerProcess
from modelhost.residency.workers.worker_startup import STARTUP_FILE, startup_phases
from modelhost.residency.workers.worker_unit import WorkerUnit
from modelhost.serve_config import (
    WORKER_COMMAND,
    WorkerConfig,
    quantize_mode,
)
from modelhost.server.app import create_app, create_routed_app
from modelhost.server.http_server import serve
from modelhost.server.observability.prometheus import SampleSource
from modelhost.server.settings import ServeSettings

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from modelhost.engine.engine import Engine
    from modelhost.inference.stage import InferenceStage
    from modelhost.models.loaded import LoadedModel
    from modelhost.residency.workers.forks import ForkServerHandle
    from modelhost.residency.workers.spare_pool import SpareWorkers


# ---------------------------------------------------------------------------------------------
# A stage, and one model's app


def kv_token_bytes_of(model: LoadedModel, settings: ServeSettings) -> int:
    """What a token's keys and values cost in `model`'s KV pool, in the --kv-cache format."""
    return kv_token_bytes(model.config, model.cache_dtype.itemsize, settings.kv_cache)


def served_window(model: LoadedModel, settings: ServeSettings, *, rows: int) -> int:
    """The window `model` is served at: the largest its model budget holds (weights, a full
    window of KV and a step's working memory) up to its trained length, or --context-length
    when smaller. On CUDA, whose pool is preallocated, the trained length (or the flag)."""
    budget = settings.model_budget_bytes if model.device.type == "cpu" else None
    return budget_window(
        model.config,
        weights_bytes=model.weights_bytes,
        dtype_bytes=model.dtype.itemsize,
        kv_token_bytes=kv_token_bytes_of(model, settings),
        budget_bytes=budget,
        context_length=settings.context_length,
        chunk_tokens=settings.chunk_tokens,
        rows=rows,
    )


def admission_policy(model: LoadedModel, settings: ServeSettings, *, rows: int) -> AdmissionPolicy:
    """The ceilings for `model`: its window (served_window: the model budget's, or
    --context-length) and the --memory-budget, and what a prompt over them gets
    (--context-overflow).

    Raises BudgetTooSmall when the budget cannot hold the weights and any context.
    """
    window = served_window(model, settings, rows=rows)
    trained = model.config.context_length
    flagged = settings.context_length is not None and settings.context_length == window < trained
    memory = None
    if settings.memory_budget_gb is not None:
        memory = plan_memory(
            model.config,
            weights_bytes=model.weights_bytes,
            dtype_bytes=model.dtype.itemsize,
            kv_token_bytes=kv_token_bytes_of(model, settings),
            memory_budget_bytes=int(settings.memory_budget_gb * BYTES_PER_GB),
            chunk_tokens=settings.chunk_tokens,
            rows=rows,
        )
    overflow: Overflow = "truncate" if settings.context_overflow == "truncate" else "error"
    return AdmissionPolicy(
        context_window=window, memory=memory, context_length_flag=flagged, overflow=overflow
    )


def build_app(
    engine: Engine, model: LoadedModel, settings: ServeSettings | None = None
) -> Starlette:
    """The server for one in-process model: `engine` already built over `model` (tests and
    embedders that build their own engine)."""
    from modelhost.inference.stage import InferenceStage

    settings = settings or ServeSettings()
    policy = admission_policy(model, settings, rows=engine.stats().batch)
    stage = InferenceStage(
        engine, model, policy=policy, defaults=settings.defaults, images=settings.images
    )
    return create_app(stage, settings)


def load_draft(
    model: LoadedModel, settings: ServeSettings, quantize: str | None = None
) -> LoadedModel | None:
    """The --draft-model to load beside `model`: None without one, or when `model` is it."""
    from modelhost.models.loading.loader import load_model

    path = settings.draft_model_path
    if path is None or Path(path).resolve() == Path(model.path).resolve():
        return None
    draft = load_model(path, quantize=quantize)
    draft.id = settings.draft_model_id or draft.id
    return draft


def build_stage(
    model: LoadedModel,
    settings: ServeSettings,
    *,
    batch: int = 8,
    max_queue: int = 64,
    quantize: str | None = None,
) -> InferenceStage:
    """The engine over `model` (its KV pool sized by the memory budget), with the
    --draft-model beside it (loaded with `quantize`), and its stage.

    Raises BudgetTooSmall when --memory-budget cannot hold the weights and any context, and
    DraftMismatch when the draft model's tokenizer is not `model`'s.
    """
    from modelhost.engine.engine import Engine, EngineConfig
    from modelhost.engine.speculation import speculate_mode
    from modelhost.inference.stage import InferenceStage
    from modelhost.models.adapters.adapter_set import AdapterSet
    from modelhost.residency.kv.kv_model_identity import prefix_store_opener
    from modelhost.residency.kv.kv_store import KVDiskStore

    policy = admission_policy(model, settings, rows=batch)
    config = EngineConfig(
        batch=batch,
        max_queue=max_queue,
        kv_cache_bytes=policy.memory.kv_bytes if policy.memory is not None else None,
        max_num_batched_tokens=settings.chunk_tokens,
        context_length=policy.context_window,
        budgeted_window=settings.model_budget_bytes is not None,
        kv_cache=parse_kv_format(settings.kv_cache),
        prompt_threads=settings.prompt_threads,
        prompt_activations=settings.prompt_activations,
        speculate=speculate_mode(settings.speculate),
        idle_hold_s=settings.kv_hold_s,
    )
    adapters = AdapterSet(model)
    for name, base, path in settings.adapters:  # AdapterRefused: this base cannot serve it
        if base == model.id:
            adapters.add(name, path)
    prefix_store = prefix_store_opener(model, KVDiskStore(budget_bytes=settings.kv_disk_bytes))
    engine = Engine(
        model, config, prefix_store=prefix_store, draft=load_draft(model, settings, quantize)
    )
    return InferenceStage(
        engine,
        model,
        policy=policy,
        defaults=settings.defaults,
        images=settings.images,
        adapters=adapters,
    )


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


# ---------------------------------------------------------------------------------------------
# The worker launch: the same command on this machine and on a cluster's node


def worker_launch(
    settings: ServeSettings,
    *,
    batch: int = 8,
    max_queue: int = 64,
    log_level: str = "warning",
    quantize: str | None = None,
    threads: int | None = None,
    adapters: AdapterCatalog | None = None,
) -> Callable[[ModelEntry], list[str]]:
    """A worker's arguments for an entry (after `WORKER_COMMAND`): its model, its operations
    and the `WorkerConfig` it serves with (`quantize` its `load_model(quantize=...)`, `threads`
    its intra-op threads; None: PyTorch's default), its own LoRA adapters among `adapters`
    as they are when it starts."""

    def arguments(entry: ModelEntry) -> list[str]:
        own = settings
        if adapters is not None:
            own = dataclasses.replace(settings, adapters=adapters.for_base(entry.id))
        config = WorkerConfig(
            own, batch=batch, max_queue=max_queue, threads=threads, quantize=quantize
        ).to_json()
        operations = ",".join(entry.operations)
        return [
            *("--model", str(entry.path), "--id", entry.id, "--operations", operations),
            *("--config", config, "--log-level", log_level),
            *(("--mmproj", str(entry.mmproj)) if entry.mmproj is not None else ()),
        ]

    return arguments


def worker_loader(
    settings: ServeSettings,
    *,
    batch: int = 8,
    max_queue: int = 64,
    log_level: str = "warning",
    start_timeout_s: float = 120.0,
    max_restarts: int = MAX_RESTARTS,
    env: Mapping[str, str] | None = None,
    quantize: str | None = None,
    threads: int | None = None,
    spares: SpareWorkers | None = None,
    forks: ForkServerHandle | None = None,
    adapters: AdapterCatalog | None = None,
) -> Callable[[ModelEntry, LoadProgress], Awaitable[WorkerUnit]]:
    """The host's `load`: spawn a worker for the entry (`env` added to its environment) and
    wait until it answers; `quantize` and `threads` as `worker_launch` takes them. With
    `spares` (built with the same `env`, following the host), a warm spare becomes the worker
    when one is ready; with `forks` (started with the same `env`), a new worker is forked from
    the fork server while it runs."""
    arguments = worker_launch(
        settings,
        batch=batch,
        max_queue=max_queue,
        log_level=log_level,
        quantize=quantize,
        threads=threads,
        adapters=adapters,
    )

    async def load(entry: ModelEntry, progress: LoadProgress) -> WorkerUnit:
        started, asked = time.perf_counter(), time.time()
        worker = WorkerProcess(
            lambda: [*WORKER_COMMAND, *arguments(entry)],  # as it is at each (re)start
            start_timeout_s=start_timeout_s,
            max_restarts=max_restarts,
            env=env,
            progress=progress,
            spares=spares,
            forks=forks,
        )
        try:
            await worker.start()
        except WorkerFailed as exc:
            raise RuntimeError(str(exc)) from None
        except BaseException:
            await worker.stop()
            raise
        unit = WorkerUnit(entry.id, entry.weights_bytes, worker)
        unit.load_ms = (time.perf_counter() - started) * 1000
        marks = {"asked": asked, "spawned": worker.spawned_at, "healthy": time.time()}
        unit.startup = startup_phases(Path(worker.socket_path).with_name(STARTUP_FILE), marks)
        await unit.read_card()
        return unit

    return load


# ---------------------------------------------------------------------------------------------
# The routed app over a router (whatever host it leases from), served until a signal


async def pin_companion(router: ModelRouter[Any], need: str) -> None:
    """Load the first local model that does `need` and pin it (`--whisper-resident`)."""
    model_id = router.route(None, need)
    async with await router.acquire(model_id):
        router.host.pin(model_id)


def serve_router(
    args: argparse.Namespace,
    settings: ServeSettings,
    router: ModelRouter[Any],
    start: Callable[[Any], Awaitable[None]],
    mode: str,
    worker_samples: SampleSource | None = None,
    spares: SpareWorkers | None = None,
    forks: ForkServerHandle | None = None,
) -> int:
    """The app over `router`, served until a signal; `start(host)` runs before listening
    (`forks`: the fork server, shown on `/engine`)."""
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

    app = create_routed_app(
        router, settings, start_all, worker_samples=worker_samples, spare_workers=spares
    )
    app.state.fork_server = forks
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


# ---------------------------------------------------------------------------------------------
# The cluster's front


def serve_cluster(args: argparse.Namespace, settings: ServeSettings) -> int:
    """`modelhost serve --cluster`: join the Ray cluster and serve its front (the only path that
    imports Ray); each node's workers get the launch a single machine's would."""
    from modelhost.cluster.serve import run_cluster

    arguments = worker_launch(
        settings,
        batch=args.batch,
        max_queue=args.max_queue,
        log_level=args.log_level,
        quantize=quantize_mode(args),
        threads=getattr(args, "threads", None),
    )
    return run_cluster(
        args, settings, worker_arguments=arguments, serve=functools.partial(serve_router, args)
    )
