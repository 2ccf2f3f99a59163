"""What a resident model costs while idle, and how many fit a budget (issue 35, part 3).

    python benchmarks/idle_footprint.py [--models M ...] [--file-1b PATH] [--budget-gb 4]
        [--prompt-words 300] [--no-measure] [--json PATH]

For each embedded model and the synthetic Llama-shaped 1B Q4_K_M file (written with
`synthetic_gguf.py --shape 1b --type Q4_K_M` when missing):
- the registry's estimate of what it holds idle (weights and the prefix cache an idle engine
  keeps) and what one request may claim on top (working memory and a full context of KV), beside
  the estimate before the pool grew with use (weights, a KV pool of 1 GiB, at least a context,
  and working memory: the same formula with the pool counted whole);
- measured: `modelhost serve MODEL` started alone (a worker process serves the model), the
  worker's RSS once it has loaded, and again a few seconds after one request (a prompt of
  `--prompt-words` words, 8 tokens generated), when its engine has given its pool back. The
  worker's RSS also holds the interpreter, PyTorch and the tokenizer (what a worker costs with no
  model at all is not subtracted).
- how many of these models fit `--budget-gb` together, before and after: models are taken
  smallest first while the idle estimates and the largest claim among them (one request on one
  model) fit; before, the whole estimates.
Prints a table and writes JSON (default benchmarks/results/idle-footprint-<time>.json).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from server_tree import ServerTree, install_cleanup

from modelhost.engine.kv.kv_pool_size import DEFAULT_KV_BYTES
from modelhost.residency.registry import ModelEntry, ModelRegistry, ServingShape
from modelhost.residency.unit import claim_bytes
from modelhost.residency.workers.supervisor import rss_bytes

GB = 1e9
EMBEDDED = ("smollm2-135m-instruct", "gemma-3-270m", "all-minilm-l6-v2")
GENERATIVE = ("generate",)
FILE_1B = Path("/tmp/synth-models/1b-q4_k_m.gguf")
SETTLE_S = 3.0  # for the engine to see it is idle and the allocator to settle


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def ensure_1b(path: Path) -> Path:
    """The shared synthetic 1B file: written once, reused by every benchmark that needs it."""
    if not path.exists():
        script = Path(__file__).with_name("synthetic_gguf.py")
        argv = [sys.executable, str(script), "--shape", "1b", "--type", "Q4_K_M", "-o", str(path)]
        subprocess.run(argv, check=True)
    return path


def old_estimate(entry: ModelEntry, shape: ServingShape) -> int:
    """The estimate when every model held a preallocated pool: weights + pool + working memory
    (the pool being the ceiling today's engine may grow to)."""
    if entry.kv_pool_bytes == 0:  # a companion: nothing changed
        return entry.estimate_bytes
    return entry.weights_bytes + entry.kv_pool_bytes + entry.work_bytes


def wait_ready(tree: ServerTree, client: httpx.Client, url: str, timeout_s: float) -> int:
    """The worker's pid once the server answers a one-token completion."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not tree.alive():
            raise RuntimeError(f"server exited:\n{tree.log_tail()}")
        try:
            response = client.post(
                f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=600
            )
            if response.status_code == 200:
                stats = client.get(f"{url}/stats").json()
                return int(stats["worker"]["pid"])
        except (httpx.TransportError, httpx.TimeoutException):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"not ready in {timeout_s:.0f} s:\n{tree.log_tail()}")


def measure(model: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """RSS of the model's worker after load and after one request."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "modelhost", "serve", model, "--port", str(port)]
    log = workdir / f"{Path(model).name}.log"
    with ServerTree(argv, dict(os.environ), log) as tree, httpx.Client() as client:
        pid = wait_ready(tree, client, url, args.start_timeout)
        time.sleep(SETTLE_S)
        after_load = rss_bytes(pid)
        prompt = " ".join(f"word{i % 97}" for i in range(args.prompt_words))
        response = client.post(
            f"{url}/v1/completions",
            json={"prompt": prompt, "max_tokens": 8, "temperature": 0},
            timeout=args.start_timeout,
        )
        response.raise_for_status()
        prompt_tokens = response.json()["usage"]["prompt_tokens"]
        time.sleep(SETTLE_S)
        after_request = rss_bytes(pid)
    return {
        "worker_rss_after_load_bytes": after_load,
        "worker_rss_after_request_bytes": after_request,
        "request_prompt_tokens": prompt_tokens,
    }


def fit_count(sizes: list[tuple[int, int]], budget: int) -> int:
    """How many (held, claim) models fit together, smallest first: every held and the largest
    claim among those taken (one request at a time)."""
    taken, held, claim = 0, 0, 0
    for size, extra in sorted(sizes):
        if held + size + max(claim, extra) > budget:
            break
        taken, held, claim = taken + 1, held + size, max(claim, extra)
    return taken


def copies_after(row: dict[str, Any], budget: int) -> int:
    """Copies of one model held idle beside one request's claim."""
    return max(0, (budget - row["claim_one_request_bytes"]) // row["estimate_idle_bytes"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="*", default=list(EMBEDDED))
    parser.add_argument("--file-1b", type=Path, default=FILE_1B)
    parser.add_argument("--budget-gb", type=float, default=4.0)
    parser.add_argument("--prompt-words", type=int, default=300)
    parser.add_argument("--start-timeout", type=float, default=900.0)
    parser.add_argument("--no-measure", action="store_true", help="estimates only")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH")
    args = parser.parse_args(argv)
    args.json = args.json or Path(f"benchmarks/results/idle-footprint-{int(time.time())}.json")
    install_cleanup()
    shape = ServingShape()
    registry = ModelRegistry([ensure_1b(args.file_1b)], shape=shape)
    names = [*args.models, args.file_1b.stem]
    workdir = Path(tempfile.mkdtemp(prefix="idle-footprint-"))
    rows: list[dict[str, Any]] = []
    for name in names:
        entry = registry.get(name)
        if entry is None:
            print(f"{name}: not a local model, skipped", flush=True)
            continue
        row: dict[str, Any] = {
            "model": name,
            "file_bytes": entry.size_bytes,
            "weights_bytes": entry.weights_bytes,
            "estimate_idle_bytes": entry.estimate_bytes,
            "claim_one_request_bytes": claim_bytes(entry, 1),
            "kv_pool_ceiling_bytes": entry.kv_pool_bytes,
            "estimate_before_bytes": old_estimate(entry, shape),
        }
        if not args.no_measure and tuple(entry.operations) == GENERATIVE:
            print(f"{name}: serving it to measure its worker", flush=True)
            try:
                target = name if entry.embedded else str(entry.path)
                row.update(measure(target, args, workdir))
            except (RuntimeError, httpx.HTTPError) as exc:
                row["error"] = str(exc)
        rows.append(row)
    budget = int(args.budget_gb * GB)
    report = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "budget_bytes": budget,
        "default_kv_pool_bytes": DEFAULT_KV_BYTES,
        "models": rows,
        "fit_before": fit_count([(r["estimate_before_bytes"], 0) for r in rows], budget),
        "fit_after": fit_count(
            [(r["estimate_idle_bytes"], r["claim_one_request_bytes"]) for r in rows], budget
        ),
        "copies_before": {r["model"]: budget // r["estimate_before_bytes"] for r in rows},
        "copies_after": {r["model"]: copies_after(r, budget) for r in rows},
    }
    print(table(report))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")


def table(report: dict[str, Any]) -> str:
    def gb(value: Any) -> str:
        return "-" if value is None else f"{value / GB:.3f}"

    head = (
        "model",
        "file GB",
        "weights",
        "est. before",
        "est. idle",
        "claim/req",
        "RSS loaded",
        "RSS after req",
        f"copies in {report['budget_bytes'] / GB:g} GB before/after",
    )
    lines = [head]
    for r in report["models"]:
        lines.append(
            (
                r["model"],
                gb(r["file_bytes"]),
                gb(r["weights_bytes"]),
                gb(r["estimate_before_bytes"]),
                gb(r["estimate_idle_bytes"]),
                gb(r["claim_one_request_bytes"]),
                gb(r.get("worker_rss_after_load_bytes")),
                gb(r.get("worker_rss_after_request_bytes")),
                f"{report['copies_before'][r['model']]} / {report['copies_after'][r['model']]}",
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)) for line in lines]
    budget = report["budget_bytes"] / GB
    out.append(
        f"all of them together in {budget:g} GB: {report['fit_before']} before, "
        f"{report['fit_after']} after (of {len(report['models'])})"
    )
    return "\n".join(out)


if __name__ == "__main__":
    main()
