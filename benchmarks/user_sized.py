"""modelhost against llama-server on the same GGUF files, one run (issue 26).

    python benchmarks/user_sized.py FILE.gguf [FILE.gguf ...] [--llama-server PATH]
        [--modelhost-only | --llama-only] [--streams 1,8] [--tokens 128] [--prefill-tokens 512]
        [--start-timeout 900] [--request-timeout 900] [--json PATH]

For each file, each server is started twice, alone on the machine, and measured from outside:
- start to first token, cold (a fresh MODELHOST_HOME: no conversion cache; the native kernels
  already built are copied in unless --count-native-build) and warm (the second start, same
  home); llama-server has no cache, so its two starts differ only by the machine's noise. The
  clock runs from spawning the server to the answer of a one-token completion, retried every
  50 ms while the server is not listening or answers 503. The file is read once beforehand so
  both servers find it in the page cache.
- memory of the server's process tree (children included), polled from /proc every 50 ms: the
  peak of each start (a conversion's peak shows in the cold one), RSS and PSS settled a few
  seconds after the first token, the peak over the whole warm run and RSS at its end (KV
  pages touched by the benchmark included); on the cold start, the bytes it cached (home/cache,
  less the native kernels).
- prefill: a ~512-token text completion, max_tokens 1, timed by the client (median of 3,
  fresh words each, so no prefix cache helps); llama-server's own `timings` are kept beside.
- TTFT and decode at each stream count, with modelhost's load generator (`modelhost.bench`):
  streamed chat, the shortest prompt the chat template allows (~12 tokens asked for; the
  template's own tokens come on top, `prompt_tokens` says how many), `--tokens` per stream,
  ignore_eos; decode is a stream's mean rate after its first token and all streams' tokens
  over the level's wall time.

llama-server runs as `-np 8 -c 16384 -t 2` (the issue's settings) plus --llama-args; modelhost
as `modelhost serve FILE` plus --modelhost-args. Prints a table per file with the ratios
modelhost / llama-server, and writes JSON (default benchmarks/results/user-sized-<time>.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from server_tree import ServerTree, install_cleanup

from modelhost.bench import BenchConfig, BenchError, prompt_text, run_bench
from modelhost.paths import modelhost_home

LLAMA_CPP = Path("/tmp/llama_cpp_python-0.3.36/vendor/llama.cpp")
# The first that exists: build-noamx is the native build without AMX, which this VM advertises
# but faults on (the default build's AMX weights crash at the first matmul).
LLAMA_SERVER_CANDIDATES = (
    LLAMA_CPP / "build-noamx/bin/llama-server",
    LLAMA_CPP / "build/bin/llama-server",
)
LLAMA_SERVER_ARGS = ("-np", "8", "-c", "16384", "-t", "2")
GB = 1e9


class StartFailed(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def read_through(path: Path) -> None:
    """Read the file once so both servers find it in the page cache."""
    with open(path, "rb") as file:
        while file.read(1 << 24):
            pass


def dir_bytes(root: Path, skip: Path | None = None) -> int:
    total = 0
    for path in root.rglob("*"):
        if skip is not None and path.is_relative_to(skip):
            continue
        if path.is_file() and not path.is_symlink():
            total += path.stat().st_size
    return total


def completion(client: httpx.Client, url: str, prompt: str, max_tokens: int) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return client.post(f"{url}/v1/completions", json=body)


def wait_first_token(tree: ServerTree, url: str, timeout_s: float) -> float:
    """Seconds from spawning `tree` to the answer of its first one-token completion."""
    deadline = tree.started + timeout_s
    with httpx.Client(timeout=httpx.Timeout(timeout_s, connect=5.0)) as client:
        while time.perf_counter() < deadline:
            if not tree.alive():
                raise StartFailed(f"exited with {tree.process.returncode}:\n{tree.log_tail()}")
            try:
                response = completion(client, url, "Hello", 1)
            except (httpx.TransportError, httpx.TimeoutException):
                time.sleep(0.05)
                continue
            if response.status_code == 200:
                return time.perf_counter() - tree.started
            if response.status_code not in (503, 404):  # loading, or not routed yet
                raise StartFailed(f"HTTP {response.status_code}: {response.text[:300]}")
            time.sleep(0.05)
    raise StartFailed(f"no first token in {timeout_s:.0f} s:\n{tree.log_tail()}")


def measure_start(tree: ServerTree, url: str, args: argparse.Namespace) -> dict[str, Any]:
    """Start to first token, the start's peak RSS, and RSS/PSS once settled."""
    seconds = wait_first_token(tree, url, args.start_timeout)
    peak = tree.peak_rss
    time.sleep(args.settle)
    return {
        "start_to_first_token_s": seconds,
        "start_peak_rss_bytes": max(peak, tree.peak_rss),
        "settled_rss_bytes": tree.rss_now(),
        "settled_pss_bytes": tree.pss_now(),
    }


def prefill(url: str, tokens: int, repeats: int, timeout_s: float) -> dict[str, Any]:
    """A ~`tokens`-token completion prompt, max_tokens 1: prompt tokens over the client's wall
    time, median of `repeats`; words calibrated on the server's own count first."""
    with httpx.Client(timeout=timeout_s) as client:
        words, counted = tokens, None
        for attempt in range(2):  # calibration, which also warms the prompt path
            text = prompt_text(words, random.Random(10_000 + attempt))
            response = completion(client, url, text, 1)
            response.raise_for_status()
            counted = response.json()["usage"]["prompt_tokens"]
            words = max(1, round(words * tokens / counted))
        rates, server_rates, counts = [], [], []
        for repeat in range(repeats):
            text = prompt_text(words, random.Random(20_000 + repeat))
            started = time.perf_counter()
            response = completion(client, url, text, 1)
            elapsed = time.perf_counter() - started
            response.raise_for_status()
            payload = response.json()
            count = payload["usage"]["prompt_tokens"]
            counts.append(count)
            rates.append(count / elapsed)
            timings = payload.get("timings") or {}
            if "prompt_per_second" in timings:
                server_rates.append(timings["prompt_per_second"])
    return {
        "prompt_tokens": statistics.median(counts),
        "prefill_tps": statistics.median(rates),
        "prefill_tps_all": rates,
        "server_prefill_tps": statistics.median(server_rates) if server_rates else None,
    }


def run_client(work: Any) -> Any:
    """The load generator on uvloop where installed (less client CPU on a shared machine)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(work)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(work)


def streams(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """One load-generator run a stream count, `--rounds` requests a client (bench.py's
    `requests` is one figure for every level)."""
    levels = {}
    for count in args.streams:
        config = BenchConfig(
            url=url,
            concurrency=(count,),
            prompt_tokens=12,
            max_tokens=args.tokens,
            requests=count * args.rounds,
            ignore_eos=True,
            timeout_s=args.request_timeout,
        )
        (level,) = run_client(run_bench(config)).levels
        levels[str(count)] = {
            "ttft_ms_p50": level.ttft_ms_p50,
            "ttft_ms_p95": level.ttft_ms_p95,
            "itl_ms_p50": level.itl_ms_p50,
            "stream_tps": level.stream_tps,
            "aggregate_tps": level.aggregate_tps,
            "prompt_tokens": level.prompt_tokens,
            "ok": level.ok,
            "requests": level.requests,
            "errors": level.errors,
        }
    return levels


def server_argv(name: str, path: Path, port: int, args: argparse.Namespace) -> list[str]:
    if name == "modelhost":
        base = (
            shlex.split(args.modelhost) if args.modelhost else [sys.executable, "-m", "modelhost"]
        )
        return [*base, "serve", str(path), "--port", str(port), *shlex.split(args.modelhost_args)]
    return [
        str(args.llama_server),
        "-m",
        str(path),
        *LLAMA_SERVER_ARGS,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *shlex.split(args.llama_args),
    ]


def fresh_home(root: Path, native: Path | None) -> Path:
    """An empty MODELHOST_HOME but for the native kernels already built (`native`)."""
    root.mkdir(parents=True, exist_ok=True)
    home = Path(tempfile.mkdtemp(prefix="home-", dir=root))
    if native is not None:
        shutil.copytree(native, home / "cache" / "native")
    return home


def measure_server(
    name: str, path: Path, args: argparse.Namespace, workdir: Path, result: dict[str, Any]
) -> None:
    """Two starts of one server on one file, into `result` (what was measured stays there if a
    later step fails): the cold start alone, then the warm start and the throughput
    measurements on it."""
    env = dict(os.environ)
    home: Path | None = None
    if name == "modelhost":
        home = fresh_home(workdir / "homes", args.native_cache)
        env["MODELHOST_HOME"] = str(home)
        result["native_cache_seeded"] = args.native_cache is not None
    try:
        measure_starts(name, path, args, workdir, env, home, result)
    finally:
        if home is not None:  # a conversion cache may hold gigabytes
            shutil.rmtree(home, ignore_errors=True)


def measure_starts(
    name: str,
    path: Path,
    args: argparse.Namespace,
    workdir: Path,
    env: dict[str, str],
    home: Path | None,
    result: dict[str, Any],
) -> None:
    for start in ("cold", "warm"):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log = workdir / f"{name}-{path.stem}-{start}.log"
        print(f"  {name}: {start} start ({log})", flush=True)
        with ServerTree(server_argv(name, path, port, args), env, log) as tree:
            result[start] = measure_start(tree, url, args)
            if start == "cold" and home is not None:
                # What loading this file cached: not the native kernels (built once per
                # machine) nor home/models, where a first start joins the embedded Whisper
                # and Gemma files whatever model it serves.
                native = home / "cache" / "native"
                result["cold"]["home_bytes"] = dir_bytes(home / "cache", skip=native)
            if start == "warm":
                tree.reset_peak()
                result["prefill"] = prefill(
                    url, args.prefill_tokens, args.prefill_repeats, args.request_timeout
                )
                result["streams"] = streams(url, args)
                result["run_peak_rss_bytes"] = max(
                    tree.peak_rss, result["warm"]["start_peak_rss_bytes"]
                )
                result["end_rss_bytes"] = tree.rss_now()


# (label, getter, unit scale, digits) for the table; getters take one server's result.
def _level(count: int, key: str):
    return lambda r: r.get("streams", {}).get(str(count), {}).get(key)


def table_rows(stream_counts: list[int]) -> list[tuple[str, Any, float, int]]:
    rows: list[tuple[str, Any, float, int]] = [
        ("start to first token, cold (s)", lambda r: r["cold"]["start_to_first_token_s"], 1, 2),
        ("start to first token, warm (s)", lambda r: r["warm"]["start_to_first_token_s"], 1, 2),
        ("peak RSS, cold start (GB)", lambda r: r["cold"]["start_peak_rss_bytes"], GB, 2),
        ("settled RSS, warm (GB)", lambda r: r["warm"]["settled_rss_bytes"], GB, 2),
        ("settled PSS, warm (GB)", lambda r: r["warm"]["settled_pss_bytes"], GB, 2),
        ("peak RSS, warm run (GB)", lambda r: r.get("run_peak_rss_bytes"), GB, 2),
        ("RSS after the run (GB)", lambda r: r.get("end_rss_bytes"), GB, 2),
        ("cache left on disk (GB)", lambda r: r["cold"].get("home_bytes"), GB, 2),
        ("prefill, 512 tokens (tok/s)", lambda r: r.get("prefill", {}).get("prefill_tps"), 1, 1),
    ]
    for count in stream_counts:
        at = f"{count} stream{'s' if count > 1 else ''}"
        rows += [
            (f"TTFT p50, {at} (ms)", _level(count, "ttft_ms_p50"), 1, 0),
            (f"decode a stream, {at} (tok/s)", _level(count, "stream_tps"), 1, 1),
            (f"decode total, {at} (tok/s)", _level(count, "aggregate_tps"), 1, 1),
        ]
    return rows


def _get(getter: Any, result: dict[str, Any] | None) -> float | None:
    if not result:
        return None
    try:
        value = getter(result)
    except (KeyError, TypeError):
        return None
    return float(value) if value is not None else None


def format_file(entry: dict[str, Any], stream_counts: list[int]) -> str:
    servers = entry["servers"]
    mh, ls = servers.get("modelhost"), servers.get("llama-server")
    header = ("figure", "modelhost", "llama-server", "modelhost/llama")
    lines = [header]
    for label, getter, scale, digits in table_rows(stream_counts):
        a, b = _get(getter, mh), _get(getter, ls)
        cells = [f"{v / scale:.{digits}f}" if v is not None else "-" for v in (a, b)]
        ratio = f"{a / b:.2f}x" if a is not None and b else "-"
        lines.append((label, *cells, ratio))
    widths = [max(len(row[i]) for row in lines) for i in range(4)]
    body = [
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in lines
    ]
    title = f"{entry['path']}  ({entry['size_bytes'] / GB:.3f} GB)"
    errors = [f"  {name}: {r['error']}" for name, r in servers.items() if "error" in r]
    return "\n".join([title, *body, *(["errors:", *errors] if errors else [])])


def ratios(entry: dict[str, Any], stream_counts: list[int]) -> dict[str, float]:
    mh, ls = entry["servers"].get("modelhost"), entry["servers"].get("llama-server")
    out = {}
    for label, getter, _scale, _digits in table_rows(stream_counts):
        a, b = _get(getter, mh), _get(getter, ls)
        if a is not None and b:
            out[label] = a / b
    return out


def git_commit() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="+", type=Path, metavar="FILE.gguf")
    parser.add_argument("--llama-server", type=Path, default=None, help="llama-server binary")
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--modelhost-only", action="store_true")
    only.add_argument("--llama-only", action="store_true")
    parser.add_argument(
        "--streams",
        type=lambda text: [int(part) for part in text.split(",")],
        default=[1, 8],
        metavar="1,8",
    )
    parser.add_argument("--tokens", type=int, default=128, help="tokens a stream (ignore_eos)")
    parser.add_argument("--rounds", type=int, default=2, help="requests a client at each level")
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--prefill-repeats", type=int, default=3)
    parser.add_argument("--start-timeout", type=float, default=900.0, metavar="S")
    parser.add_argument("--request-timeout", type=float, default=900.0, metavar="S")
    parser.add_argument(
        "--settle", type=float, default=3.0, metavar="S",
        help="seconds after the first token before settled memory is read",
    )  # fmt: skip
    parser.add_argument(
        "--modelhost", default=None, metavar="CMD",
        help="the modelhost command (default: this Python's -m modelhost)",
    )  # fmt: skip
    parser.add_argument("--modelhost-args", default="", metavar="ARGS")
    parser.add_argument(
        "--llama-args", default="", metavar="ARGS",
        help="extra llama-server arguments, e.g. '--no-repack'",
    )  # fmt: skip
    parser.add_argument(
        "--count-native-build", action="store_true",
        help="do not copy the built native kernels into the fresh home",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, default=None, metavar="PATH")
    args = parser.parse_args(argv)
    if args.llama_server is None:
        found = [p for p in LLAMA_SERVER_CANDIDATES if p.exists()]
        args.llama_server = found[0] if found else Path("llama-server")
    native = modelhost_home() / "cache" / "native"
    args.native_cache = None if args.count_native_build or not native.is_dir() else native
    args.json = args.json or Path(f"benchmarks/results/user-sized-{int(time.time())}.json")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    install_cleanup()
    names = (
        ["modelhost"]
        if args.modelhost_only
        else ["llama-server"]
        if args.llama_only
        else ["modelhost", "llama-server"]
    )
    workdir = Path(tempfile.mkdtemp(prefix="user-sized-"))
    print(f"logs and homes under {workdir}", flush=True)
    report: dict[str, Any] = {
        "commit": git_commit(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": {
            "cpus": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
        },
        "llama_server": str(args.llama_server),
        "llama_server_args": [*LLAMA_SERVER_ARGS, *shlex.split(args.llama_args)],
        "modelhost_args": shlex.split(args.modelhost_args),
        "streams": args.streams,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "native_cache_seeded": args.native_cache is not None,
        "files": [],
    }
    try:
        for path in args.files:
            entry: dict[str, Any] = {
                "path": str(path),
                "size_bytes": path.stat().st_size,
                "servers": {},
            }
            report["files"].append(entry)
            print(f"{path}: reading it into the page cache", flush=True)
            read_through(path)
            for name in names:
                result = entry["servers"][name] = {}
                try:
                    measure_server(name, path, args, workdir, result)
                except (StartFailed, BenchError, httpx.HTTPError, KeyError) as exc:
                    result["error"] = f"{type(exc).__name__}: {exc}"
                    print(f"  {name} failed: {exc}", flush=True)
            entry["ratios"] = ratios(entry, args.streams)
            print(format_file(entry, args.streams), flush=True)
            write_json(report, args.json)
    except BaseException as exc:  # Ctrl-C, SIGTERM: the JSON says the run was cut short
        report["aborted"] = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        write_json(report, args.json)
        shutil.rmtree(workdir / "homes", ignore_errors=True)
        print(f"wrote {args.json}", flush=True)


def write_json(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
