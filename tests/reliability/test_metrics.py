"""`GET /metrics`: Prometheus text that parses, request figures that move with requests, and
engine, residency and jobs gauges read when scraped."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from reliability_support import HELLO, AppFactory, ClientFactory
from scripted_engine import ScriptedEngine, scripted_model

from modelhost.inference.stage import InferenceStage
from modelhost.residency.host import ResidencyHost
from modelhost.residency.inprocess import InProcessUnit
from modelhost.residency.registry import ModelEntry
from modelhost.residency.router import ModelRouter
from modelhost.residency.unit import LoadProgress
from modelhost.server.app import create_routed_app
from modelhost.server.settings import ServeSettings

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scrape(client: httpx.AsyncClient) -> Samples:
    """Every sample of `/metrics`, by (name, sorted labels)."""
    response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


CHAT = "/v1/chat/completions"


async def test_metrics_parse_as_prometheus_text_with_every_family_declared(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    response = await client_of(make_app()).get("/metrics")
    names = {family.name for family in text_string_to_metric_families(response.text)}
    assert {
        "modelhost_http_requests",
        "modelhost_time_to_first_token_seconds",
        "modelhost_inter_token_latency_seconds",
        "modelhost_e2e_request_latency_seconds",
        "modelhost_request_queue_seconds",
        "modelhost_prompt_tokens",
        "modelhost_generation_tokens",
        "modelhost_running_rows",
        "modelhost_waiting_rows",
        "modelhost_kv_blocks_used",
        "modelhost_kv_blocks_free",
        "modelhost_prefix_cache_hit_ratio",
    } <= names


async def test_a_chat_request_moves_the_request_token_and_latency_figures(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    client = client_of(make_app())
    answer = (await client.post(CHAT, json=HELLO)).json()
    samples = await scrape(client)
    requests = value(
        samples, "modelhost_http_requests_total", method="POST", route=CHAT, status="200"
    )
    assert requests == 1
    prompt = value(samples, "modelhost_prompt_tokens_total", route=CHAT)
    assert prompt == answer["usage"]["prompt_tokens"]
    assert value(samples, "modelhost_generation_tokens_total", route=CHAT) == 4
    for histogram in (
        "modelhost_time_to_first_token_seconds",
        "modelhost_inter_token_latency_seconds",
        "modelhost_e2e_request_latency_seconds",
        "modelhost_request_queue_seconds",
    ):
        assert value(samples, f"{histogram}_count", route=CHAT) == 1, histogram


async def test_a_streamed_request_is_counted_when_its_stream_ends(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    client = client_of(make_app())
    response = await client.post(CHAT, json={**HELLO, "stream": True})
    assert response.text.rstrip().endswith("data: [DONE]")
    samples = await scrape(client)
    labels = {"method": "POST", "route": CHAT, "status": "200"}
    assert value(samples, "modelhost_http_requests_total", **labels) == 1
    assert value(samples, "modelhost_time_to_first_token_seconds_count", route=CHAT) == 1


async def test_refusals_are_counted_under_their_status_and_unknown_paths_under_one_label(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    client = client_of(make_app())
    await client.post(CHAT, json={})
    await client.get("/no/such/path/1")
    await client.get("/no/such/path/2")
    samples = await scrape(client)
    labels = {"method": "POST", "route": CHAT, "status": "400"}
    assert value(samples, "modelhost_http_requests_total", **labels) == 1
    unknown = {"method": "GET", "route": "unmatched", "status": "404"}
    assert value(samples, "modelhost_http_requests_total", **unknown) == 2


async def test_engine_gauges_show_a_running_row_while_it_streams(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    engine = ScriptedEngine(["a", "b"], stall_after=1, stall_s=30)
    client = client_of(make_app(engine))

    async def stream() -> None:
        async with client.stream("POST", CHAT, json={**HELLO, "stream": True}) as response:
            async for _ in response.aiter_lines():
                pass

    streaming = asyncio.create_task(stream())
    for _ in range(200):
        samples = await scrape(client)
        if value(samples, "modelhost_running_rows", model="scripted-model") == 1:
            break
        await asyncio.sleep(0.01)
    assert value(samples, "modelhost_running_rows", model="scripted-model") == 1
    assert value(samples, "modelhost_kv_blocks_used", model="scripted-model") == 1
    stats = engine.stats()
    free = stats.kv_blocks_total - stats.kv_blocks_used
    assert value(samples, "modelhost_kv_blocks_free", model="scripted-model") == free
    streaming.cancel()
    await asyncio.gather(streaming, return_exceptions=True)


async def test_each_app_keeps_its_own_registry(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    first, second = client_of(make_app()), client_of(make_app())
    await first.post(CHAT, json=HELLO)
    samples = await scrape(second)
    labels = {"method": "POST", "route": CHAT, "status": "200"}
    assert value(samples, "modelhost_http_requests_total", **labels) is None


async def test_a_jobs_subsystem_reports_jobs_by_state_through_its_hook(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    app = make_app()
    app.state.job_counts = lambda: {"running": 2, "queued": 1}
    samples = await scrape(client_of(app))
    assert value(samples, "modelhost_jobs", state="running") == 2
    assert value(samples, "modelhost_jobs", state="queued") == 1


def routed_app(tmp_path: Path) -> tuple[Any, ResidencyHost[Any]]:
    entries = {
        name: ModelEntry(name, tmp_path / name, "safetensors", "llama", 1000, 1000, 1000)
        for name in ("a", "b")
    }

    async def load(entry: Any, progress: LoadProgress) -> InProcessUnit:
        return InProcessUnit(InferenceStage(ScriptedEngine(), scripted_model(entry.id)))

    class Registry:
        def get(self, model_id: str) -> ModelEntry | None:
            return entries.get(model_id)

        def entries(self) -> list[ModelEntry]:
            return list(entries.values())

    host: ResidencyHost[Any] = ResidencyHost(budget_bytes=1500, source=entries.get, load=load)
    router = ModelRouter(host, Registry(), current="a")
    return create_routed_app(router, ServeSettings()), host


async def test_residency_figures_count_loads_and_evictions_and_show_resident_bytes(
    tmp_path: Path, client_of: ClientFactory
) -> None:
    app, host = routed_app(tmp_path)
    client = client_of(app)
    assert (await client.post(CHAT, json={**HELLO, "model": "a"})).status_code == 200
    assert (await client.post(CHAT, json={**HELLO, "model": "b"})).status_code == 200
    samples = await scrape(client)
    assert value(samples, "modelhost_model_loads_total", model="a") == 1
    assert value(samples, "modelhost_model_loads_total", model="b") == 1
    assert value(samples, "modelhost_model_load_seconds_count") == 2
    assert value(samples, "modelhost_model_evictions_total", reason="evicted") == 1
    assert value(samples, "modelhost_resident_bytes", model="b", state="ready") is not None
    assert value(samples, "modelhost_resident_bytes", model="a", state="ready") is None
    assert value(samples, "modelhost_residency_budget_bytes") == 1500
    assert value(samples, "modelhost_running_rows", model="b") == 0
    await host.close()


class FakeWorker:
    restarts = 2


class FakeWorkerUnit:
    """A worker-process unit as the metrics see it: no local stage, a `/stats` to ask."""

    resumed = False
    worker = FakeWorker()
    model_id = "w"

    def measured_bytes(self) -> int | None:
        return 500

    async def refresh(self) -> None:
        return None

    async def give_back_idle_memory(self) -> None:
        return None

    def broken(self) -> bool:
        return False

    def pause(self) -> None:
        return None

    def resume(self) -> None:
        return None

    def interrupt(self) -> None:
        return None

    async def close(self) -> bool:
        return True

    async def get_json(self, path: str) -> dict[str, Any]:
        assert path == "/stats"
        return {
            "batch": {"active_rows": 3, "pending_rows": 1},
            "prompt_cache": {"query_tokens": 10, "hit_tokens": 4},
        }


async def test_worker_units_report_rows_from_their_stats_and_their_restarts(
    tmp_path: Path, client_of: ClientFactory
) -> None:
    app, host = routed_app(tmp_path)
    entry = ModelEntry("w", tmp_path / "w", "safetensors", "llama", 500, 500, 500)
    host.adopt(entry, FakeWorkerUnit())
    samples = await scrape(client_of(app))
    assert value(samples, "modelhost_running_rows", model="w") == 3
    assert value(samples, "modelhost_waiting_rows", model="w") == 1
    assert value(samples, "modelhost_prefix_cache_hit_ratio", model="w") == 0.4
    assert value(samples, "modelhost_worker_restarts_total", model="w") == 2
    assert value(samples, "modelhost_kv_blocks_used", model="w") is None
    await host.close()
