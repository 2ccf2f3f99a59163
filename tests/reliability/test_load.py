"""Load on a real server: 200 streaming requests from 32 concurrent clients, with early
disconnects and bad bodies mixed in, over two scripted models and then over two tiny real models
in their worker processes. Nothing answers 500, every good request completes or gets 429, and
afterwards every lease, row and KV block is back, no socket is left open, and each worker's
resident memory is within 10% of what it was before the load."""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
from live_server import LiveServer, open_tcp_fds
from scripted_engine import ScriptedEngine, scripted_model

from modelhost.assembly import worker_loader
from modelhost.inference.stage import InferenceStage
from modelhost.residency.host import ResidencyHost
from modelhost.residency.inprocess import InProcessUnit
from modelhost.residency.registry import ModelEntry, ModelRegistry, ServingShape
from modelhost.residency.router import ModelRouter
from modelhost.residency.unit import LoadProgress
from modelhost.residency.workers.supervisor import rss_bytes
from modelhost.residency.workers.worker_unit import WorkerUnit
from modelhost.server.app import create_routed_app
from modelhost.server.settings import ServeSettings

REQUESTS = 200
CLIENTS = 32
SCRIPT = tuple(f" w{i}" for i in range(24))
MESSAGES = [{"role": "user", "content": "count"}]
BAD_BODIES = [
    b"{not json",
    b"[]",
    json.dumps({"messages": "nope"}).encode(),
    json.dumps({"messages": MESSAGES, "max_tokens": -3}).encode(),
    json.dumps({"messages": MESSAGES, "temperature": "hot"}).encode(),
    b'{"messages": ' + b"[" * 1000 + b"]" * 1000 + b"}",
]
# A Responses stream its max_output_tokens cut ends with response.incomplete, as the API's.
ENDINGS = {
    "/v1/chat/completions": ("data: [DONE]",),
    "/v1/messages": ("event: message_stop",),
    "/v1/responses": ("event: response.completed", "event: response.incomplete"),
}


class World:
    """Two scripted models behind a routed app; every engine made is kept for the checks."""

    def __init__(self, tmp_path: Path) -> None:
        self.engines: list[ScriptedEngine] = []
        entries = {
            name: ModelEntry(name, tmp_path / name, "safetensors", "llama", 10, 10, 10)
            for name in ("a", "b")
        }

        async def load(entry: Any, progress: LoadProgress) -> InProcessUnit:
            engine = ScriptedEngine(SCRIPT, step_s=0.004, batch=4, max_queue=8)
            self.engines.append(engine)
            return InProcessUnit(InferenceStage(engine, scripted_model(entry.id)))

        class Registry:
            def get(self, model_id: str) -> ModelEntry | None:
                return entries.get(model_id)

            def entries(self) -> list[ModelEntry]:
                return list(entries.values())

        self.host: ResidencyHost[Any] = ResidencyHost(
            budget_bytes=1000, source=entries.get, load=load
        )
        self.app = create_routed_app(ModelRouter(self.host, Registry(), "a"), ServeSettings())


def body_for(path: str, model: str, stream: bool, max_tokens: int | None = None) -> dict[str, Any]:
    if path == "/v1/responses":
        body: dict[str, Any] = {"model": model, "input": "count", "stream": stream}
        return body if max_tokens is None else {**body, "max_output_tokens": max_tokens}
    body = {"model": model, "messages": MESSAGES, "stream": stream}
    if path == "/v1/messages":
        return {**body, "max_tokens": max_tokens or 64}
    return body if max_tokens is None else {**body, "max_tokens": max_tokens}


async def one_request(
    client: httpx.AsyncClient,
    rng: random.Random,
    outcomes: Counter[str],
    problems: list[str],
    models: tuple[str, ...] = ("a", "b"),
    max_tokens: int | None = None,
) -> None:
    roll = rng.random()
    path = rng.choice(sorted(ENDINGS))
    model = rng.choice(models)
    if roll < 0.15:
        body = rng.choice(BAD_BODIES)
        response = await client.post(path, content=body)
        outcomes[f"bad {response.status_code}"] += 1
        if not 400 <= response.status_code < 500:
            problems.append(f"bad body {body[:40]!r} got {response.status_code}")
        return
    disconnect_after = rng.randint(1, 10) if roll < 0.40 else None
    payload = body_for(path, model, stream=True, max_tokens=max_tokens)
    async with client.stream("POST", path, json=payload) as response:
        if response.status_code == 429:
            outcomes["429"] += 1
            return
        if response.status_code != 200:
            problems.append(f"{path} answered {response.status_code}: {await response.aread()!r}")
            return
        lines: list[str] = []
        async for line in response.aiter_lines():
            if line:
                lines.append(line)
            if disconnect_after is not None and len(lines) >= disconnect_after:
                outcomes["left early"] += 1
                return  # leaving the block closes the connection mid-stream
    ended = any(ending in lines for ending in ENDINGS[path])
    if not ended or any(is_error_frame(line) for line in lines):
        problems.append(f"{path} stream did not complete: {lines[-3:]}")
    outcomes["completed"] += 1


def is_error_frame(line: str) -> bool:
    return line.startswith(("event: error", 'data: {"error"', "event: response.failed"))


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def run_load(base_url: str, seed: int, **request: Any) -> tuple[Counter[str], list[str]]:
    rng = random.Random(seed)
    outcomes: Counter[str] = Counter()
    problems: list[str] = []
    queue: asyncio.Queue[int] = asyncio.Queue()
    for number in range(REQUESTS):
        queue.put_nowait(number)
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=0)

    async def client_loop() -> None:
        async with httpx.AsyncClient(base_url=base_url, timeout=30, limits=limits) as client:
            while not queue.empty():
                queue.get_nowait()
                await one_request(client, rng, outcomes, problems, **request)

    await asyncio.wait_for(asyncio.gather(*(client_loop() for _ in range(CLIENTS))), 300)
    return outcomes, problems


def settled(world: World) -> bool:
    leases = [m.leases for m in world.host.resident()]
    stats = [engine.stats() for engine in world.engines]
    rows = [s.active_rows + s.pending_rows + s.kv_blocks_used for s in stats]
    return not any(leases) and not any(rows)


def test_200_streams_from_32_clients_leave_no_500_no_lease_and_no_used_kv_block(
    tmp_path: Path, live_server: Any
) -> None:
    world = World(tmp_path)
    server = live_server(world.app)
    fds_before = open_fds()
    outcomes, problems = asyncio.run(run_load(server.base_url, seed=7))
    assert problems == []
    assert sum(outcomes.values()) == REQUESTS
    assert outcomes["completed"] > 0 and outcomes["left early"] > 0
    assert all(key in ("completed", "left early", "429") or key.startswith("bad 4")
               for key in outcomes), outcomes  # fmt: skip
    deadline = time.monotonic() + 10
    while not settled(world) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert settled(world), ([m for m in world.host.resident()], [e.stats() for e in world.engines])
    stats = httpx.get(f"{server.base_url}/stats").json()
    assert stats["batch"]["active_rows"] == 0 and stats["batch"]["pending_rows"] == 0
    assert all(row["leases"] == 0 for row in stats["models"]["resident"])
    assert open_fds() <= fds_before + 2  # the sockets of 200 requests are all closed


@pytest.mark.slow
def test_200_streams_on_a_real_model_in_its_worker_leave_its_memory_and_kv_pool_as_they_were(
    models_dir: Path, tmp_path: Path
) -> None:
    registry = ModelRegistry(
        [models_dir], home=tmp_path / "h", hf_hub=tmp_path / "hub", embedded=False,
        shape=ServingShape(batch=8),
    )  # fmt: skip
    host: ResidencyHost[WorkerUnit] = ResidencyHost(
        budget_bytes=10**12, source=registry.get, load=worker_loader(ServeSettings(), batch=8)
    )
    app = create_routed_app(ModelRouter(host, registry, "tiny-a"), ServeSettings())
    with LiveServer(app) as server:
        warm = asyncio.run(run_load(server.base_url, seed=1, models=MODELS, max_tokens=8))
        assert warm[1] == []
        workers = {m.id: host.peek(m.id) for m in host.resident()}
        assert sorted(workers) == list(MODELS)
        rss_before = {model: rss_bytes(unit.pid) for model, unit in workers.items()}
        tcp_before = open_tcp_fds()
        outcomes, problems = asyncio.run(
            run_load(server.base_url, seed=11, models=MODELS, max_tokens=16)
        )
        assert problems == []
        assert outcomes["completed"] > 0 and outcomes["left early"] > 0
        deadline = time.monotonic() + 30
        while any(m.leases for m in host.resident()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(m.leases == 0 for m in host.resident())
        for model, unit in workers.items():
            assert host.peek(model) is unit  # no worker died or was replaced under the load
            batch = worker_stats(unit.worker.socket_path)["batch"]
            assert (batch["active_rows"], batch["pending_rows"], batch["kv_bytes"]) == (0, 0, 0)
            rss = rss_bytes(unit.pid)
            assert rss is not None and rss <= rss_before[model] * 1.10, (model, rss_before, rss)
            assert open_tcp_fds(unit.pid) == 0  # no client socket it was handed is left open
        # Keep-alive connections to the workers' Unix sockets may stay pooled; every TCP
        # connection of the 200 requests must be closed.
        assert open_tcp_fds() <= tcp_before + 2
    assert host.resident() == []


MODELS = ("tiny-a", "tiny-b")


def worker_stats(socket_path: str) -> dict[str, Any]:
    """A worker's own /stats, over its private socket; its KV rows are waited out first."""
    transport = httpx.HTTPTransport(uds=socket_path)
    with httpx.Client(transport=transport, base_url="http://worker", timeout=10) as client:
        deadline = time.monotonic() + 30
        while True:
            stats: dict[str, Any] = client.get("/stats").json()
            batch = stats["batch"]
            idle = batch["active_rows"] == batch["pending_rows"] == batch["kv_bytes"] == 0
            if idle or time.monotonic() > deadline:
                return stats
            time.sleep(0.05)
