"""A short prompt's first token, modelhost beside llama-server on the same GGUF files (issue 48).

    python benchmarks/first_token.py [MODEL ...] [--streams 1 8] [--rounds 5] [--requests 6]
        [--llama-server PATH] [--modelhost-args ARGS] [--json PATH]

MODEL: a GGUF path or an embedded model's name (default: smollm2-135m-instruct and the
synthetic 1B and 3B Q4_K_M files under /tmp/synth-models, which `synthetic_gguf.py` writes).
For each model both servers run at once on free ports (modelhost `serve` with its worker
process, on a home of its own kept between models so the packed weights are mapped; llama-server
`-np 8 -c 16384 -t <cores>`), idle but for the requests sent. Each round sends, to one server
then the other (the order alternates round by round, so a shared machine's load falls on both
alike), streamed chat completions with a short user message (~10 tokens):

- `cached`: the same message every time: both servers find the whole prompt in their prefix
  caches but for its last tokens;
- `fresh`: a message of different words each time (the chat template's opening still cached).

at each stream count (`--streams`: that many clients at once, `--requests` requests each). The
time to the first token is the client's, from sending the request to the first streamed chunk
carrying generated text (`ignore_eos`, greedy). Each round's median per server, then the
median over rounds and the ratio modelhost / llama-server (below 1: modelhost first). Prints
the machine's load average beside the figures: other work on a shared machine moves absolute
figures by 2-3x, ratios much less. Writes JSON (default
benchmarks/results/first-token-<time>.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from server_tree import ServerTree, install_cleanup
from user_sized import LLAMA_SERVER_CANDIDATES, free_port, read_through

DEFAULT_MODELS = [
    "smollm2-135m-instruct",
    "/tmp/synth-models/1b-q4_k_m.gguf",
    "/tmp/synth-models/3b-q4_k_m.gguf",
]
LLAMA_PATHS = (Path("/work/llama-server/bin/llama-server"), *LLAMA_SERVER_CANDIDATES)
CACHED_MESSAGE = "Name one colour of the sky, in a single word."
WORDS = [
    "river",
    "stone",
    "lamp",
    "cloud",
    "orange",
    "window",
    "garden",
    "silver",
    "paper",
    "winter",
    "market",
    "bridge",
    "candle",
    "forest",
    "engine",
    "harbor",
    "pencil",
    "thunder",
    "velvet",
    "meadow",
]
SERVERS = ("modelhost", "llama-server")


def message(kind: str, rng: random.Random) -> str:
    if kind == "cached":
        return CACHED_MESSAGE
    return "Say something about " + " ".join(rng.sample(WORDS, 6)) + "."


async def first_token_ms(client: httpx.AsyncClient, url: str, text: str) -> float:
    body = {
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    started = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        first = None
        async for line in response.aiter_lines():
            if first is not None or not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            choices = json.loads(line[5:]).get("choices") or [{}]
            delta = choices[0].get("delta") or {}
            if delta.get("content") or choices[0].get("finish_reason"):
                first = 1000 * (time.perf_counter() - started)
    if first is None:
        raise RuntimeError(f"{url}: a stream with no token")
    return first


async def level(url: str, kind: str, streams: int, requests: int, seed: int) -> float:
    """The median first-token time of `streams` clients sending `requests` requests each."""
    # A connection a request, for both: llama-server (cpp-httplib) closes a kept-alive one
    # after a few requests, and a request sent on it meanwhile fails.
    limits = httpx.Limits(max_connections=streams, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def one_client(index: int) -> list[float]:
            rng = random.Random(seed * 1000 + index)
            return [await first_token_ms(client, url, message(kind, rng)) for _ in range(requests)]

        results = await asyncio.gather(*(one_client(i) for i in range(streams)))
    return statistics.median(t for times in results for t in times)


def wait_ready(tree: ServerTree, url: str, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not tree.alive():
            raise RuntimeError(f"{tree.argv[0]} exited:\n{tree.log_tail()}")
        try:
            asyncio.run(level(url, "cached", 1, 1, 0))
            return
        except (httpx.HTTPError, RuntimeError):
            time.sleep(0.5)
    raise RuntimeError(f"{tree.argv[0]} did not answer in {timeout_s:.0f} s:\n{tree.log_tail()}")


def model_path(name: str) -> Path:
    if name.endswith(".gguf"):
        return Path(name)
    from modelhost.models.loading.loader import resolve

    return Path(resolve(name).path)


def measure_model(name: str, args: argparse.Namespace, home: Path, logs: Path) -> dict[str, Any]:
    path = model_path(name)
    read_through(path)
    cores = str(os.cpu_count() or 1)
    ports = {server: free_port() for server in SERVERS}
    urls = {server: f"http://127.0.0.1:{port}" for server, port in ports.items()}
    argv = {
        "modelhost": [sys.executable, "-m", "modelhost", "serve", str(path)]
        + ["--port", str(ports["modelhost"]), *args.modelhost_args.split()],
        "llama-server": [str(args.llama_server), "-m", str(path), "-np", "8", "-c", "16384"]
        + ["-t", cores, "--host", "127.0.0.1", "--port", str(ports["llama-server"])],
    }
    env = {**os.environ, "MODELHOST_HOME": str(home)}
    stem = path.stem
    trees = {s: ServerTree(argv[s], env, logs / f"{stem}-{s}.log") for s in SERVERS}
    figures: dict[str, dict[str, list[float]]] = {}
    try:
        for server in SERVERS:
            wait_ready(trees[server], urls[server])
        time.sleep(args.settle)  # modelhost's first load writes its packed weights meanwhile
        for round_index in range(args.rounds):
            order = SERVERS if round_index % 2 == 0 else SERVERS[::-1]
            for kind in ("cached", "fresh"):
                for streams in args.streams:
                    key = f"{kind}_{streams}"
                    for server in order:
                        try:
                            ms = asyncio.run(
                                level(urls[server], kind, streams, args.requests, round_index)
                            )
                        except httpx.HTTPError as exc:
                            raise RuntimeError(
                                f"{server}: {exc!r}\n{trees[server].log_tail()}"
                            ) from exc
                        figures.setdefault(key, {}).setdefault(server, []).append(ms)
            print(f"  {stem}: round {round_index + 1} of {args.rounds}", file=sys.stderr)
    finally:
        for tree in trees.values():
            tree.stop()
    result: dict[str, Any] = {"file": str(path)}
    for key, by_server in figures.items():
        medians = {server: statistics.median(values) for server, values in by_server.items()}
        result[key] = {
            **{f"{server}_ms": ms for server, ms in medians.items()},
            **{f"{server}_rounds_ms": values for server, values in by_server.items()},
            "ratio": medians["modelhost"] / medians["llama-server"],
        }
    return result


def table(report: dict[str, Any]) -> str:
    lines = [
        "| model | prompt | streams | modelhost ms | llama-server ms | modelhost / llama |",
        "|---|---|---|---|---|---|",
    ]
    for name, result in report["models"].items():
        for key, row in result.items():
            if key == "file":
                continue
            kind, streams = key.split("_")
            lines.append(
                f"| {Path(name).stem} | {kind} | {streams} | {row['modelhost_ms']:.0f} "
                f"| {row['llama-server_ms']:.0f} | {row['ratio']:.2f}x |"
            )
    load = report["meta"]["loadavg"]
    lines.append(f"\nload average before / after: {load['before']} / {load['after']}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("models", nargs="*", default=DEFAULT_MODELS, metavar="MODEL")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=5, help="alternations of the two servers")
    parser.add_argument("--requests", type=int, default=6, help="requests a client a level")
    parser.add_argument("--settle", type=float, default=5.0, metavar="S", help="wait once up")
    parser.add_argument("--llama-server", type=Path, default=None)
    parser.add_argument("--modelhost-args", default="", metavar="ARGS")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH")
    args = parser.parse_args(argv)
    if args.llama_server is None:
        args.llama_server = next((p for p in LLAMA_PATHS if p.exists()), None)
        if args.llama_server is None:
            parser.error("no llama-server found: --llama-server PATH")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    install_cleanup()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = args.json or Path("benchmarks/results") / f"first-token-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "cores": os.cpu_count(),
        "args": {k: str(v) for k, v in vars(args).items()},
        "loadavg": {"before": [round(x, 2) for x in os.getloadavg()], "after": None},
    }
    report: dict[str, Any] = {"meta": meta, "models": {}}
    with tempfile.TemporaryDirectory(prefix="first-token-") as work:
        home, logs = Path(work) / "home", Path(work) / "logs"
        logs.mkdir()
        for name in args.models:
            report["models"][name] = measure_model(name, args, home, logs)
            meta["loadavg"]["after"] = [round(x, 2) for x in os.getloadavg()]
            out.write_text(json.dumps(report, indent=1))  # each model's figures as they come
    print(table(report))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
