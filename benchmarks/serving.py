"""What serving adds on top of the engine: HTTP + SSE overhead, and the prefix cache on turn two.

    .venv/bin/python benchmarks/serving.py [--model smollm2-135m-instruct] [--tokens 128]
                                           [--prefix-tokens 500] [--repeats 3] [--threads N]
                                           [--client httpx|socket] [--workers] [--cluster]
                                           [--out FILE]

One process, one model, one engine: the same greedy stream (EOS ignored) is decoded straight
from the engine and through a real HTTP server on 127.0.0.1 (the OpenAI chat route, streamed,
read in a child process by httpx, as a user's client would be, or by a bare socket),
alternately, so both see the same machine. With `--workers` the server runs the model in a
worker process, as `modelhost serve` does, and the engine's own stream is decoded from a second
copy in this process. The overhead is the HTTP stream's time per token over the engine's. On a
machine with few cores that figure also holds the client's own reading and whatever else shares
the cores, so the CPU a token of the server's event-loop thread (HTTP, SSE framing, the socket
writes; with `--workers`, the front's and the worker's together) and of the client are reported
beside it. Then a conversation with a `--prefix-tokens` system prompt: the second turn's time to
first token against the first's (its prefix comes from the KV cache). Prints a table and writes
JSON (default benchmarks/results/serving-<time>.json).

`--cluster` (implies `--workers`) also serves the model through `modelhost serve --cluster`
over a one-node Ray cluster started on this machine (`ray start --head --block` in its own
process group, tests/cluster_nodes.py): its worker is a Ray actor's process reached over TCP
with the cluster secret, and the front relays each token (no socket handoff across machines).
Its streams alternate with the local worker's, and the table adds the cluster path's time per
token and its difference from the local worker path's."""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import re
import socket
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import torch

from modelhost.assembly import build_serving, worker_loader
from modelhost.engine.engine import share_the_gil_with_the_engine
from modelhost.engine.sampling.sampling_params import SamplingParams
from modelhost.inference.contracts import ChatPrompt, InferenceRequest
from modelhost.inference.prompt import prompt_ids_for
from modelhost.models.loading.loader import load_model
from modelhost.residency.host import ResidencyHost
from modelhost.residency.registry import ModelRegistry, ServingShape
from modelhost.residency.router import ModelRouter
from modelhost.server.app import create_routed_app
from modelhost.server.http_server import server_for
from modelhost.server.observability.prometheus import WorkerSamples
from modelhost.server.settings import ServeSettings

CONTENT = re.compile(r'"content":"[^"]')  # a chunk that carries text (not the opening role)
CONTENT_BYTES = re.compile(CONTENT.pattern.encode())
FILLER = "The quick brown fox jumps over the lazy dog while the sun sets slowly in the west. "


def chat_body(messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    return {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }


async def engine_stream(app: Any, messages: list[dict[str, str]], tokens: int) -> float:
    """Seconds per token after the first, decoding straight from the engine."""
    stage = app.state.stage
    request = InferenceRequest("bench", "chat", ChatPrompt(tuple(messages)))
    prompt = prompt_ids_for(stage.model, request)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    stamps = []
    async for event in stage.engine.submit(prompt, params):
        if event.token_ids:
            stamps.append(time.perf_counter())
    return (stamps[-1] - stamps[0]) / max(len(stamps) - 1, 1)


def thread_cpu_s(thread: threading.Thread) -> float:
    """CPU seconds `thread` (of this process) has used, for the server's event loop."""
    assert thread.ident is not None
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def worker_loop_cpu_s(worker_pid: int | None) -> float:
    """CPU seconds of a worker's main thread (its event loop), from the kernel's schedstat (ns);
    0 without a worker."""
    if worker_pid is None:
        return 0.0
    schedstat = Path(f"/proc/{worker_pid}/task/{worker_pid}/schedstat").read_text()
    return int(schedstat.split()[0]) / 1e9


def routed_worker_app(
    model_name: str, settings: ServeSettings
) -> tuple[Any, ResidencyHost[Any], str]:
    """The app `modelhost serve` builds, its host and the model's id: the model loads into a
    worker on its first request."""
    registry = ModelRegistry(shape=ServingShape(batch=8))
    entry = registry.resolve_argument(model_name)
    assert entry is not None, f"no model '{model_name}'"
    samples = WorkerSamples()
    load = worker_loader(settings, batch=8, env=samples.env())
    host: ResidencyHost[Any] = ResidencyHost(budget_bytes=10**12, source=registry.get, load=load)
    router = ModelRouter(host, registry, current=entry.id)
    app = create_routed_app(router, settings, worker_samples=samples)
    return app, host, entry.id


def http_stream_in_child(
    url: str, messages: list[dict[str, str]], tokens: int
) -> tuple[float, float, float]:
    """(seconds to the first token, seconds per token after it, the client's CPU seconds)
    through HTTP + SSE."""
    started = time.perf_counter()
    cpu = time.process_time()
    stamps = []
    with (
        httpx.Client(timeout=600) as client,
        client.stream(
            "POST", f"{url}/v1/chat/completions", json=chat_body(messages, tokens)
        ) as response,
    ):
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {") and CONTENT.search(line):
                stamps.append(time.perf_counter())
    per_token = (stamps[-1] - stamps[0]) / max(len(stamps) - 1, 1)
    return stamps[0] - started, per_token, time.process_time() - cpu


def socket_stream_in_child(
    url: str, messages: list[dict[str, str]], tokens: int
) -> tuple[float, float, float]:
    """`http_stream_in_child`'s figures from the least a client can do: one socket, the request
    written by hand, each read stamped if it carries text (a token's frame arrives alone, ~ms
    after the one before). Its CPU a token is a fraction of httpx's, so on a machine with few
    cores the wall-clock overhead is more the server's own."""
    started = time.perf_counter()
    cpu = time.process_time()
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps(chat_body(messages, tokens)).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    ).encode()
    stamps = []
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(head + body)
        while data := sock.recv(65536):
            if CONTENT_BYTES.search(data):
                stamps.append(time.perf_counter())
    per_token = (stamps[-1] - stamps[0]) / max(len(stamps) - 1, 1)
    return stamps[0] - started, per_token, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prefix-tokens", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--port", type=int, default=18931)
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 1) - 1))
    parser.add_argument(
        "--client",
        choices=("httpx", "socket"),
        default="httpx",
        help="the streaming client: httpx, as a user's would be, or a bare socket (the least a "
        "client costs; on few cores the wall-clock overhead is then more the server's own)",
    )
    parser.add_argument(
        "--workers",
        action="store_true",
        help="serve the model from a worker process, as `modelhost serve` does",
    )
    parser.add_argument(
        "--cluster",
        action="store_true",
        help="also stream through `serve --cluster` on a one-node Ray cluster (implies --workers)",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    args.workers = args.workers or args.cluster
    share_the_gil_with_the_engine()  # as `modelhost serve` does where engines run
    torch.set_num_threads(args.threads)  # as `modelhost serve` sets them

    model = load_model(args.model)
    app = build_serving(model, ServeSettings(), batch=8)
    served_app, host, model_id = app, None, model.id
    if args.workers:
        served_app, host, model_id = routed_worker_app(args.model, ServeSettings())
    server = server_for(served_app, host="127.0.0.1", port=args.port, log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{args.port}"
    # The client reads in its own process: in this one it would contend for the GIL with the
    # engine thread and the server's event loop, and count its own parsing as server overhead.
    client = multiprocessing.get_context("spawn").Pool(1)

    stream_in_child = http_stream_in_child if args.client == "httpx" else socket_stream_in_child

    def http_stream(
        messages: list[dict[str, str]], tokens: int, at: str = url
    ) -> tuple[float, float, float]:
        return client.apply(stream_in_child, (at, messages, tokens))

    cluster = start_cluster(args.model) if args.cluster else None
    through_cluster: list[float] = []
    cluster_front_cpu_s = 0.0
    try:
        hello = [{"role": "user", "content": "Tell me a long story."}]
        http_stream(hello, 8)  # warm-up (and, with --workers, the worker's start)
        if cluster is not None:
            http_stream(hello, 8, cluster[1].base_url)
        worker = host.peek(model_id) if host is not None else None
        worker_pid = worker.pid if worker is not None else None
        direct, served = [], []
        loop_cpu_s = worker_cpu_s = client_cpu_s = 0.0
        for _ in range(args.repeats):
            loop_before, worker_before = thread_cpu_s(thread), worker_loop_cpu_s(worker_pid)
            _, per_token, cpu_s = http_stream(hello, args.tokens)
            loop_cpu_s += thread_cpu_s(thread) - loop_before
            worker_cpu_s += worker_loop_cpu_s(worker_pid) - worker_before
            client_cpu_s += cpu_s
            served.append(per_token)
            direct.append(asyncio.run(engine_stream(app, hello, args.tokens)))
            if cluster is not None:
                front_before = process_cpu_s(cluster[1].process.pid)
                through_cluster.append(http_stream(hello, args.tokens, cluster[1].base_url)[1])
                cluster_front_cpu_s += process_cpu_s(cluster[1].process.pid) - front_before
        overhead = statistics.median(served) / statistics.median(direct) - 1
        streamed_tokens = args.repeats * args.tokens

        first_ttft, second_ttft = [], []
        for _ in range(args.repeats):
            system = f"{uuid.uuid4().hex} " + FILLER * (args.prefix_tokens // 18 + 1)
            system = model.tokenizer.decode(model.tokenizer.encode(system)[: args.prefix_tokens])
            turn1 = [{"role": "system", "content": system}, {"role": "user", "content": "Hi."}]
            first_ttft.append(http_stream(turn1, 16)[0])
            turn2 = [*turn1, {"role": "assistant", "content": "Hello!"}]
            turn2.append({"role": "user", "content": "And then?"})
            second_ttft.append(http_stream(turn2, 16)[0])
    finally:
        client.terminate()
        server.should_exit = True
        thread.join(timeout=30)
        if cluster is not None:
            cluster[1].stop()
            cluster[0].stop()

    result = {
        "model": args.model,
        "threads": args.threads,
        "client": args.client,
        "serving": ("cluster, " if args.cluster else "")
        + ("workers" if args.workers else "in-process"),
        "tokens": args.tokens,
        "engine_ms_per_token": statistics.median(direct) * 1000,
        "http_ms_per_token": statistics.median(served) * 1000,
        "http_overhead": overhead,
        "server_loop_cpu_us_per_token": (loop_cpu_s + worker_cpu_s) / streamed_tokens * 1e6,
        "worker_loop_cpu_us_per_token": worker_cpu_s / streamed_tokens * 1e6,
        "client_cpu_us_per_token": client_cpu_s / streamed_tokens * 1e6,
        "prefix_tokens": args.prefix_tokens,
        "turn1_ttft_ms": statistics.median(first_ttft) * 1000,
        "turn2_ttft_ms": statistics.median(second_ttft) * 1000,
    }
    result["turn2_over_turn1"] = result["turn2_ttft_ms"] / result["turn1_ttft_ms"]
    if through_cluster:
        result["cluster_ms_per_token"] = statistics.median(through_cluster) * 1000
        result["cluster_minus_workers_ms_per_token"] = (
            result["cluster_ms_per_token"] - result["http_ms_per_token"]
        )
        cluster_ms, workers_ms = result["cluster_ms_per_token"], result["http_ms_per_token"]
        result["cluster_over_workers"] = cluster_ms / workers_ms
        # The whole front process (its event loop, and Ray's threads in it), a relayed token.
        result["cluster_front_cpu_us_per_token"] = cluster_front_cpu_s / streamed_tokens * 1e6
    result["server_loop_share"] = (
        result["server_loop_cpu_us_per_token"] / 1000 / result["http_ms_per_token"]
    )
    print(f"{'figure':<30} {'value':>10}")
    for key in (
        "engine_ms_per_token",
        "http_ms_per_token",
        "server_loop_cpu_us_per_token",
        "worker_loop_cpu_us_per_token",
        "client_cpu_us_per_token",
        "turn1_ttft_ms",
        "turn2_ttft_ms",
        "cluster_ms_per_token",
        "cluster_minus_workers_ms_per_token",
        "cluster_front_cpu_us_per_token",
    ):
        if key in result:
            print(f"{key:<34} {result[key]:>10.3f}")
    for key in ("http_overhead", "server_loop_share", "turn2_over_turn1", "cluster_over_workers"):
        if key in result:
            print(f"{key:<34} {result[key]:>10.1%}")
    write_result(result, args.out, "serving")


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user and system) process `pid` has used, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_cluster(model: str) -> tuple[Any, Any]:
    """A one-node Ray cluster on this machine and `serve --cluster` over it, serving `model`."""
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from cluster_nodes import ClusterFront, RayNodes

    root = Path(tempfile.mkdtemp(prefix="modelhost-bench-cluster-"))
    nodes = RayNodes(root, [100_000], [[]]).start()
    try:
        engine_flags = ["--batch", "8", "--hold", "0"]
        front = ClusterFront(nodes, [model], root / "front", engine_flags).wait_ready()
    except BaseException:
        nodes.stop()
        raise
    return nodes, front


def write_result(result: dict[str, Any], out: str | None, stem: str) -> None:
    """`result` as JSON in `out`, or in benchmarks/results/<stem>-<time>.json."""
    path = Path(out or f"benchmarks/results/{stem}-{int(time.time())}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
