"""`GET /metrics`: the Prometheus registry of an app, its instruments and its collectors.

Each app owns a `Metrics` (its own `CollectorRegistry`: tests build many apps). Request figures
are observed as requests end; what describes engines, residency and jobs is read when scraped:

| metric                                        | kind      | labels                |
| --------------------------------------------- | --------- | --------------------- |
| modelhost_http_requests_total                 | counter   | method, route, status |
| modelhost_time_to_first_token_seconds         | histogram | route                 |
| modelhost_inter_token_latency_seconds         | histogram | route                 |
| modelhost_e2e_request_latency_seconds         | histogram | route                 |
| modelhost_request_queue_seconds               | histogram | route                 |
| modelhost_prompt_tokens_total                 | counter   | route                 |
| modelhost_generation_tokens_total             | counter   | route                 |
| modelhost_running_rows, _waiting_rows         | gauge     | model                 |
| modelhost_kv_blocks_used, _free               | gauge     | model                 |
| modelhost_prefix_cache_hit_ratio              | gauge     | model                 |
| modelhost_prefix_cache_{query,hit}_tokens     | counter   | model                 |
| modelhost_resident_bytes, _residency_budget   | gauge     | model / -             |
| modelhost_model_loads_total, _load_seconds    | counter / histogram | model       |
| modelhost_model_load_failures_total           | counter   | model                 |
| modelhost_model_evictions_total               | counter   | reason                |
| modelhost_worker_restarts_total               | counter   | model                 |
| modelhost_jobs                                | gauge     | state                 |

The inter-token latency is each request's mean gap between tokens after the first; the queue
time runs from arrival to the engine taking the row (waiting for a model to load included).

A request served by a worker process is observed there. The workers write their request series
(time to first token, inter-token, end to end, queue, tokens) to files in the front's
`WorkerSamples` directory (prometheus-client's multiprocess mode), and the front's scrape adds
them to its own: every request counts whichever process served it, and a worker's requests
still count after it was evicted or respawned (its files stay). A cluster's front has another
`SampleSource`: its nodes' workers write theirs on their own nodes, asked for when scraped.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
)
from prometheus_client import generate_latest as exposition
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.samples import Sample
from starlette.requests import Request
from starlette.responses import Response

from modelhost.server.edge.request_context import RequestOutcome

disable_created_metrics()  # no `_created` twin for every counter and histogram

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
TOKEN_GAP_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1, 2.5, 5)
LOAD_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class Metrics:
    """The app's Prometheus registry: request instruments, plus `ServingCollector` over `state`."""

    def __init__(self, state: Any, worker_samples: SampleSource | None = None) -> None:
        self.registry = registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter(
            "modelhost_http_requests",
            "HTTP requests by route template and final status (499: the client left)",
            ["method", "route", "status"],
            registry=registry,
        )
        # The request series: registered through RequestSeries, which adds the workers' samples.
        self.ttft = Histogram(
            "modelhost_time_to_first_token_seconds",
            "Seconds from arrival to the first generated token",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=None,
        )
        self.token_gap = Histogram(
            "modelhost_inter_token_latency_seconds",
            "Each request's mean seconds between generated tokens after the first",
            ["route"],
            buckets=TOKEN_GAP_BUCKETS,
            registry=None,
        )
        self.e2e = Histogram(
            "modelhost_e2e_request_latency_seconds",
            "Seconds from arrival to the end of the response, for inference requests",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=None,
        )
        self.queue = Histogram(
            "modelhost_request_queue_seconds",
            "Seconds from arrival until the engine took the row (model load waits included)",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=None,
        )
        self.prompt_tokens = Counter(
            "modelhost_prompt_tokens", "Prompt tokens admitted", ["route"], registry=None
        )
        self.generation_tokens = Counter(
            "modelhost_generation_tokens", "Tokens generated", ["route"], registry=None
        )
        series: list[Counter | Histogram] = [self.ttft, self.token_gap, self.e2e, self.queue]
        series += [self.prompt_tokens, self.generation_tokens]
        self.worker_samples = worker_samples
        registry.register(RequestSeries(series, worker_samples))
        self.model_loads = Counter(
            "modelhost_model_loads", "Models loaded into residency", ["model"], registry=registry
        )
        self.model_load_failures = Counter(
            "modelhost_model_load_failures", "Model loads that failed", ["model"], registry=registry
        )
        self.model_load_seconds = Histogram(
            "modelhost_model_load_seconds",
            "Seconds a model took to load",
            buckets=LOAD_BUCKETS,
            registry=registry,
        )
        self.model_evictions = Counter(
            "modelhost_model_evictions",
            "Models released from residency, by reason (evicted, requested, broken, closing)",
            ["reason"],
            registry=registry,
        )
        self.handed_off_streams = Counter(
            "modelhost_worker_streams_handed_off",
            "Event streams a worker wrote straight to the client's socket, not relayed",
            registry=registry,
        )
        self.serving = ServingCollector(state)
        registry.register(self.serving)

    async def refresh(self) -> None:
        """What is read elsewhere, fetched before a scrape: the workers' stats and series."""
        fetches = [self.serving.refresh()]
        if self.worker_samples is not None:
            fetches.append(self.worker_samples.refresh())
        await asyncio.gather(*fetches)

    def render(self) -> bytes:
        return exposition(self.registry)

    def observe_request(self, outcome: RequestOutcome) -> None:
        route = outcome.route.partition(" ")[2] or outcome.route
        self.e2e.labels(route).observe(outcome.total_s)
        if outcome.prompt_tokens is not None:
            self.prompt_tokens.labels(route).inc(outcome.prompt_tokens)
        if outcome.completion_tokens:
            self.generation_tokens.labels(route).inc(outcome.completion_tokens)
        if outcome.ttft_s is not None:
            self.ttft.labels(route).observe(outcome.ttft_s)
        if outcome.token_gap_s is not None:
            self.token_gap.labels(route).observe(outcome.token_gap_s)
        if outcome.queue_s is not None:
            self.queue.labels(route).observe(outcome.queue_s)

    def residency_event(self, name: str, payload: Mapping[str, Any]) -> None:
        """The residency host's `publish` events: loads, failed loads and unloads."""
        model = str(payload.get("id", ""))
        if name == "model.load" and payload.get("phase") == "finished":
            self.model_loads.labels(model).inc()
            self.model_load_seconds.observe(float(payload.get("ms", 0.0)) / 1000)
        elif name == "model.load" and payload.get("phase") == "failed":
            self.model_load_failures.labels(model).inc()
        elif name == "model.unload":
            self.model_evictions.labels(str(payload.get("reason", "unknown"))).inc()

    def watch_residency(self, host: Any) -> None:
        """Count `host`'s load and unload events."""
        host.subscribe(self.residency_event)


class SampleSource(Protocol):
    """Where the workers' request series come from: `families()` by family name, each
    summed over its workers; `refresh()` fetches what is not read in place."""

    def families(self) -> dict[str, Metric]: ...

    async def refresh(self) -> None: ...

    def close(self) -> None: ...


def read_samples(directory: str) -> dict[str, Metric]:
    """The request series the worker processes wrote to `directory`, summed over the workers,
    by family name."""
    files = glob.glob(os.path.join(directory, "*.db"))
    return {family.name: family for family in MultiProcessCollector.merge(files)}


class WorkerSamples:
    """The directory where worker processes write their request series, and its reading.

    A worker finds it in its environment (`env()`, given when it is spawned); prometheus-client
    then keeps each of its counters and histograms in a file there, by process id."""

    def __init__(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="modelhost-metrics-")

    def env(self) -> dict[str, str]:
        return {"PROMETHEUS_MULTIPROC_DIR": self.directory}

    def families(self) -> dict[str, Metric]:
        """Every worker's series, summed over the workers, by family name."""
        return read_samples(self.directory)

    async def refresh(self) -> None:
        """Nothing to fetch: the files are read as the scrape collects."""

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


class RequestSeries:
    """The front's own request instruments, each with the workers' samples of it added."""

    def __init__(
        self, instruments: Sequence[Counter | Histogram], worker_samples: SampleSource | None
    ) -> None:
        self.instruments = instruments
        self.worker_samples = worker_samples

    def collect(self) -> Iterator[Metric]:
        theirs = self.worker_samples.families() if self.worker_samples is not None else {}
        for instrument in self.instruments:
            for family in instrument.collect():
                added = theirs.get(family.name)
                if added is not None:
                    family.samples = _summed([*family.samples, *added.samples])
                yield family


def _summed(samples: list[Sample]) -> list[Sample]:
    """One sample per name and labels, the values added, in exposition order (each label set's
    buckets by bound, then its count and sum)."""
    values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for sample in samples:
        key = (sample.name, tuple(sorted(sample.labels.items())))
        values[key] = values.get(key, 0.0) + sample.value

    def order(key: tuple[str, tuple[tuple[str, str], ...]]) -> tuple[Any, ...]:
        name, labels = key
        series = tuple(item for item in labels if item[0] != "le")
        bound = float(dict(labels).get("le", "0"))
        return series, name.endswith("_sum"), name.endswith("_count"), bound

    return [
        Sample(name, dict(labels), values[name, labels])
        for name, labels in sorted(values, key=order)
    ]


class ServingCollector:
    """Gauges read at scrape time from the app's state: engines, residency, workers and jobs.

    A single-model app has `state.stage`; a routed one has `state.router`, whose resident units
    with a local `.stage` report their engine (worker-process units report restarts only).
    A jobs subsystem may leave `state.job_counts`, a callable returning {state: count}.
    Worker-process units are asked for their `/stats` before each scrape (`refresh`): they
    report rows and prefix-cache tokens, but not KV blocks.
    """

    def __init__(self, state: Any) -> None:
        self.state = state
        self.worker_stats: dict[str, Mapping[str, Any]] = {}

    async def refresh(self, timeout_s: float = 2.0) -> None:
        """Fetch every worker unit's `/stats` (a unit that does not answer in time is left out)."""
        router = getattr(self.state, "router", None)
        workers = [] if router is None else [
            (model_id, unit) for model_id, unit in self._units(router)
            if getattr(unit, "stage", None) is None and hasattr(unit, "get_json")
        ]  # fmt: skip

        async def fetch(unit: Any) -> Any:
            with contextlib.suppress(Exception):
                return await asyncio.wait_for(unit.get_json("/stats"), timeout_s)
            return None

        answers = await asyncio.gather(*(fetch(unit) for _, unit in workers))
        self.worker_stats = {
            model_id: answer
            for (model_id, _), answer in zip(workers, answers, strict=True)
            if isinstance(answer, dict)
        }

    def collect(self) -> Iterator[Metric]:
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
            "running": GaugeMetricFamily(
                "modelhost_running_rows", "Rows decoding now", labels=["model"]
            ),
            "waiting": GaugeMetricFamily(
                "modelhost_waiting_rows", "Rows waiting for a batch slot", labels=["model"]
            ),
            "kv_used": GaugeMetricFamily(
                "modelhost_kv_blocks_used", "KV cache blocks held by live rows", labels=["model"]
            ),
            "kv_free": GaugeMetricFamily(
                "modelhost_kv_blocks_free",
                "KV cache blocks free (including ones that still hold a reusable prefix)",
                labels=["model"],
            ),
            "hit_ratio": GaugeMetricFamily(
                "modelhost_prefix_cache_hit_ratio",
                "Prompt tokens served from the prefix cache over prompt tokens looked up",
                labels=["model"],
            ),
            "queried": CounterMetricFamily(
                "modelhost_prefix_cache_query_tokens",
                "Prompt tokens looked up in the prefix cache",
                labels=["model"],
            ),
            "hits": CounterMetricFamily(
                "modelhost_prefix_cache_hit_tokens",
                "Prompt tokens found in the prefix cache",
                labels=["model"],
            ),
            "drafted": CounterMetricFamily(
                "modelhost_spec_draft_tokens",
                "Tokens guessed ahead by speculation and verified",
                labels=["model"],
            ),
            "accepted": CounterMetricFamily(
                "modelhost_spec_accepted_tokens",
                "Guessed tokens the model agreed with (kept without a step of their own)",
                labels=["model"],
            ),
            "model_drafted": CounterMetricFamily(
                "modelhost_spec_draft_model_tokens",
                "Tokens guessed ahead by the draft model (--draft-model) and verified",
                labels=["model"],
            ),
            "model_accepted": CounterMetricFamily(
                "modelhost_spec_draft_model_accepted_tokens",
                "The draft model's guesses the model agreed with",
                labels=["model"],
            ),
            "draft_forwards": CounterMetricFamily(
                "modelhost_spec_draft_model_forwards",
                "Forward passes of the draft model",
                labels=["model"],
            ),
        }
        for model_id, stats in self._engine_stats():
            families["running"].add_metric([model_id], stats.active_rows)
            families["waiting"].add_metric([model_id], stats.pending_rows)
            families["kv_used"].add_metric([model_id], stats.kv_blocks_used)
            families["kv_free"].add_metric([model_id], stats.kv_blocks_total - stats.kv_blocks_used)
            queried, hits = stats.prefix_query_tokens, stats.prefix_hit_tokens
            families["hit_ratio"].add_metric([model_id], hits / queried if queried else 0.0)
            families["queried"].add_metric([model_id], queried)
            families["hits"].add_metric([model_id], hits)
            families["drafted"].add_metric([model_id], getattr(stats, "spec_draft_tokens", 0))
            families["accepted"].add_metric([model_id], getattr(stats, "spec_accepted_tokens", 0))
            for name, field in (
                ("model_drafted", "spec_model_draft_tokens"),
                ("model_accepted", "spec_model_accepted_tokens"),
                ("draft_forwards", "spec_draft_forwards"),
            ):
                families[name].add_metric([model_id], getattr(stats, field, 0))
        for model_id, stats in self.worker_stats.items():
            batch, cache = stats.get("batch") or {}, stats.get("prompt_cache") or {}
            families["running"].add_metric([model_id], batch.get("active_rows", 0))
            families["waiting"].add_metric([model_id], batch.get("pending_rows", 0))
            queried, hits = cache.get("query_tokens", 0), cache.get("hit_tokens", 0)
            families["hit_ratio"].add_metric([model_id], hits / queried if queried else 0.0)
            families["queried"].add_metric([model_id], queried)
            families["hits"].add_metric([model_id], hits)
            speculation = stats.get("speculation") or {}
            families["drafted"].add_metric([model_id], speculation.get("draft_tokens", 0))
            families["accepted"].add_metric([model_id], speculation.get("accepted_tokens", 0))
            for name, key in (
                ("model_drafted", "draft_model_tokens"),
                ("model_accepted", "draft_model_accepted_tokens"),
                ("draft_forwards", "draft_model_forwards"),
            ):
                families[name].add_metric([model_id], speculation.get(key, 0))
        yield from families.values()
        yield from self._residency()
        yield from self._jobs()

    def _engine_stats(self) -> Iterator[tuple[str, Any]]:
        for model_id, stage in self._stages():
            read = getattr(getattr(stage, "engine", None), "stats", None)
            if read is None:
                continue  # an encoder without a batching engine
            try:
                stats = read()
            except Exception:
                continue  # a unit closing under the scrape
            if hasattr(stats, "kv_blocks_total"):
                yield model_id, stats

    def _stages(self) -> Iterator[tuple[str, Any]]:
        router = getattr(self.state, "router", None)
        if router is None:
            stage = getattr(self.state, "stage", None)
            if stage is not None:
                yield stage.model_id, stage
            return
        for model_id, unit in self._units(router):
            stage = getattr(unit, "stage", None)
            if stage is not None:
                yield model_id, stage

    @staticmethod
    def _units(router: Any) -> Iterator[tuple[str, Any]]:
        seen = set()  # a cluster lists each replica of a model: one series a model
        for resident in router.host.resident():
            unit = router.host.peek(resident.id)
            if unit is not None and resident.id not in seen:
                seen.add(resident.id)
                yield resident.id, unit

    def _residency(self) -> Iterator[Metric]:
        router = getattr(self.state, "router", None)
        if router is None:
            return
        resident = GaugeMetricFamily(
            "modelhost_resident_bytes", "Bytes each resident model holds", labels=["model", "state"]
        )
        held: dict[tuple[str, str], int] = {}
        for model in router.host.resident():  # a cluster's replicas of one model: summed
            held[(model.id, model.state)] = held.get((model.id, model.state), 0) + model.bytes
        for (model_id, state), num_bytes in held.items():
            resident.add_metric([model_id, state], num_bytes)
        yield resident
        yield GaugeMetricFamily(
            "modelhost_residency_budget_bytes",
            "The residency budget (--model-budget)",
            value=router.host.budget_bytes,
        )
        restarts = CounterMetricFamily(
            "modelhost_worker_restarts", "Worker process restarts", labels=["model"]
        )
        for model_id, unit in self._units(router):
            worker = getattr(unit, "worker", None)
            if worker is not None:
                restarts.add_metric([model_id], getattr(worker, "restarts", 0))
        yield restarts

    def _jobs(self) -> Iterator[Metric]:
        counts = getattr(self.state, "job_counts", None)
        if not callable(counts):
            return
        try:
            by_state = dict(counts())
        except Exception:
            return
        jobs = GaugeMetricFamily("modelhost_jobs", "Jobs by state", labels=["state"])
        for state, count in sorted(by_state.items()):
            jobs.add_metric([str(state)], count)
        yield jobs


async def metrics_endpoint(request: Request) -> Response:
    """`GET /metrics`: the Prometheus text exposition of this app's registry."""
    metrics: Metrics = request.app.state.metrics
    await metrics.refresh()
    return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)
