"""Speculation on and off: the same server binary, `--speculate auto` against `--speculate none`.

    .venv/bin/python benchmarks/speculation.py [--models smollm2-135m-instruct gemma-3-270m]
                                               [--tokens 400] [--modes none auto]
                                               [--port 8391] [--out FILE]

For each model and mode, `modelhost serve MODEL --speculate MODE` starts in its own process
group (stopped by this script), and one stream at a time asks it, greedy, for `--tokens` tokens
(EOS ignored) of two answers: one that copies from its context (a few hundred tokens of code
shown back with a rename) and a free story. Per answer: decode tok/s (tokens after the first
over the time from the first to the last, read from the SSE stream), the guesses made and
accepted (from `/stats` before and after), whether the answer is the one `none` gave, and the
server process's CPU time a token (from /proc: on a shared machine it moves far less than the
wall clock does). With `--repeats N` the modes alternate N times and each figure is the median.
Prints a table and writes JSON (default benchmarks/results/speculation-<time>.json)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

CODE = """import csv
from dataclasses import dataclass


@dataclass
class Order:
    order_id: str
    customer: str
    amount: float
    paid: bool


def load_orders(path):
    orders = []
    with open(path, newline="") as handle:
        for row in csv.DictReader(handle):
            orders.append(
                Order(
                    order_id=row["order_id"],
                    customer=row["customer"],
                    amount=float(row["amount"]),
                    paid=row["paid"] == "yes",
                )
            )
    return orders


def total_unpaid(orders):
    total = 0.0
    for order in orders:
        if not order.paid:
            total += order.amount
    return total


def customers_owing(orders):
    owing = {}
    for order in orders:
        if not order.paid:
            owing[order.customer] = owing.get(order.customer, 0.0) + order.amount
    return sorted(owing.items(), key=lambda item: item[1], reverse=True)
"""
REQUESTS = {
    "copy": CODE + "\nRename load_orders to read_orders in the code above and print the full code.",
    "story": "Write a long story about a lighthouse keeper who finds a message in a bottle.",
}


def start_server(model: str, mode: str, port: int) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "modelhost", "serve", model, "--port", str(port)]
    command += ["--speculate", mode, "--in-process"]
    process = subprocess.Popen(command, start_new_session=True)  # its own process group
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(process)
    raise RuntimeError("the server did not start")


def stop_server(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def speculation(base: str) -> dict[str, Any]:
    stats: dict[str, Any] = httpx.get(f"{base}/stats", timeout=30).json()
    return stats.get("speculation", {})


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of process `pid` and its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def ask(base: str, model: str, content: str, tokens: int, pid: int) -> dict[str, Any]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    before = speculation(base)
    cpu_before = cpu_seconds(pid)
    text: list[str] = []
    first = last = 0.0
    usage: dict[str, Any] = {}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    last = time.perf_counter()
                    first = first or last
                    text.append(piece)
    cpu = cpu_seconds(pid) - cpu_before
    after = speculation(base)
    completion = int(usage.get("completion_tokens", 0))
    drafted = after.get("draft_tokens", 0) - before.get("draft_tokens", 0)
    accepted = after.get("accepted_tokens", 0) - before.get("accepted_tokens", 0)
    return {
        "text": "".join(text),
        "completion_tokens": completion,
        "decode_tok_s": (completion - 1) / (last - first) if last > first else None,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance": accepted / drafted if drafted else None,
        "cpu_ms_per_token": 1000 * cpu / completion if completion else None,
        "mode_in_effect": after.get("mode"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "gemma-3-270m"])
    parser.add_argument("--modes", nargs="+", default=["none", "auto"])
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--port", type=int, default=8391)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    results: list[dict[str, Any]] = []
    for model in args.models:
        runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for _ in range(args.repeats):
            for mode in args.modes:
                process = start_server(model, mode, args.port)
                try:
                    base = f"http://127.0.0.1:{args.port}"
                    ask(base, model, "Say hello.", 8, process.pid)  # warm up
                    for name, content in REQUESTS.items():
                        result = ask(base, model, content, args.tokens, process.pid)
                        runs.setdefault((mode, name), []).append(result)
                finally:
                    stop_server(process)
        baseline: dict[str, dict[str, Any]] = {}
        for (mode, name), found in runs.items():
            result = median_of(found)
            result.update(model=model, mode=mode, request=name, repeats=len(found))
            first = baseline.setdefault(name, result)
            result["same_answer"] = all(r["text"] == first["text"] for r in found)
            result["speedup"] = (
                result["decode_tok_s"] / first["decode_tok_s"]
                if result["decode_tok_s"] and first["decode_tok_s"]
                else None
            )
            results.append(result)

    header = f"{'model':24} {'request':6} {'mode':6} {'tok/s':>7} {'x':>5} {'cpu ms/tok':>10} "
    header += f"{'drafted':>7} {'accepted':>8} {'rate':>5} same"
    print(header)
    for r in results:
        rate = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "-"
        speed = f"{r['decode_tok_s']:.1f}" if r["decode_tok_s"] else "-"
        ratio = f"{r['speedup']:.2f}" if r["speedup"] else "-"
        cpu = f"{r['cpu_ms_per_token']:.2f}" if r["cpu_ms_per_token"] else "-"
        print(
            f"{r['model']:24} {r['request']:6} {r['mode']:6} {speed:>7} {ratio:>5} {cpu:>10} "
            f"{r['draft_tokens']:>7} {r['accepted_tokens']:>8} {rate:>5} {r['same_answer']}"
        )
    out = (
        args.out
        or Path("benchmarks/results") / f"speculation-{time.strftime('%Y%m%d-%H%M%S')}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"tokens": args.tokens, "results": results}, indent=2))
    print(f"wrote {out}")


def median_of(found: list[dict[str, Any]]) -> dict[str, Any]:
    """The first run's record with each figure replaced by the median over the runs."""
    result = dict(found[0])
    for key in ("decode_tok_s", "cpu_ms_per_token", "draft_tokens", "accepted_tokens"):
        values = [r[key] for r in found if r[key] is not None]
        result[key] = statistics.median(values) if values else None
    drafted, accepted = result["draft_tokens"], result["accepted_tokens"]
    result["acceptance"] = accepted / drafted if drafted else None
    return result


if __name__ == "__main__":
    main()
