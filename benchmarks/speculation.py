"""Speculation on and off, with a draft model, and against llama-server's n-gram speculation.

    .venv/bin/python benchmarks/speculation.py [--models smollm2-135m-instruct gemma-3-270m]
        [--tokens 400] [--streams 1 8] [--repeats 1] [--port 8391] [--out FILE]
        [--configs none auto draft llama llama-ngram-simple llama-ngram-mod]
        [--draft-model ID_OR_PATH] [--llama-server PATH]

Configurations, each a server started on its own in its own process group (stopped by this
script), on the same model file:

- `none`, `auto`, `ngram`: `modelhost serve MODEL --in-process --speculate MODE`;
- `draft`, `auto-draft`: `--speculate draft|auto --draft-model DRAFT` (default DRAFT: a hard link
  of the model's own file under another name: every guess lands, and the draft costs what the
  model does, the figure a draft as large as the model reaches; pass a smaller model with the
  same tokenizer for a real one);
- `llama`, `llama-ngram-simple`, `llama-ngram-mod`: llama-server on the same GGUF file, plain and
  with `--spec-type ngram-simple|ngram-mod` (8 slots).

Each is asked, greedy, for `--tokens` tokens (EOS ignored) of two answers: one that copies from
its context (a few hundred tokens of code to show back with a rename) and a free story, by 1 stream
and by 8 concurrent streams (`--streams`). Per answer: decode tok/s (one stream: tokens after the
first over the time from the first to the last, read from the SSE stream; N streams: all their
tokens over the time from the first token to the last, aggregate), the guesses made and accepted
(modelhost's `usage.completion_tokens_details`, llama-server's `timings.draft_n` and
`draft_n_accepted`), whether the answer is the one the same server's plain configuration gave,
and (modelhost, one stream) the server's CPU time a token (/proc). With `--repeats N` each figure
is the median of N runs. Prints a table and writes JSON (default
benchmarks/results/speculation-<time>.json)."""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
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
# The copy request asks for the code back whole: phrased as "print the full code" after the
# code, SmolLM2-135M writes a loose paraphrase of it (about half its guesses land, at most
# 1.4x fewer steps whatever verification costs); asked first and shown the code in a fence, it
# shows the code back and then repeats its own lines, which its context guesses as well.
REQUESTS = {
    "copy": "Rename the function load_orders to read_orders in this code. Reply with the "
    "complete updated code only.\n\n```python\n" + CODE + "```",
    "story": "Write a long story about a lighthouse keeper who finds a message in a bottle.",
}


LLAMA_SERVER = Path(
    "/work/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server"
)
MODELHOST_CONFIGS = {
    "none": ["--speculate", "none"],
    "auto": ["--speculate", "auto"],
    "ngram": ["--speculate", "ngram"],
    "draft": ["--speculate", "draft", "--draft-model", "{draft}"],
    "auto-draft": ["--speculate", "auto", "--draft-model", "{draft}"],
}
LLAMA_CONFIGS = {
    "llama": [],
    "llama-ngram-simple": ["--spec-type", "ngram-simple"],
    "llama-ngram-mod": ["--spec-type", "ngram-mod"],
}
BASELINE = {name: "none" for name in MODELHOST_CONFIGS} | {name: "llama" for name in LLAMA_CONFIGS}


def server_command(config: str, model: str, file: Path, port: int, args: Any) -> list[str]:
    if config in MODELHOST_CONFIGS:
        flags = [flag.format(draft=args.draft_model or "") for flag in MODELHOST_CONFIGS[config]]
        return [
            *(sys.executable, "-m", "modelhost", "serve", model, "--port", str(port)),
            "--in-process", *flags,
        ]  # fmt: skip
    return [
        *(str(args.llama_server), "-m", str(file), "--port", str(port), "--host", "127.0.0.1"),
        *("-c", "32768", "-np", "8", "--no-webui"), *LLAMA_CONFIGS[config],
    ]  # fmt: skip


def start_server(command: list[str], port: int) -> subprocess.Popen[bytes]:
    # Its own process group; no stdin (llama-server reads its EOF as an interrupt).
    process = subprocess.Popen(
        command,
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,  # llama-server logs every slot's timings
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{command[0]} exited with {process.returncode}")
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


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of process `pid` and its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stream_one(base: str, model: str, content: str, tokens: int) -> dict[str, Any]:
    """One streamed greedy answer: its text, tokens, first and last token times and guesses."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    text: list[str] = []
    first = last = 0.0
    usage: dict[str, Any] = {}
    timings: dict[str, Any] = {}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=900) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
            for choice in chunk.get("choices", []):
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    last = time.perf_counter()
                    first = first or last
                    text.append(piece)
    details = usage.get("completion_tokens_details") or {}
    accepted = details.get("accepted_prediction_tokens")
    drafted = None if accepted is None else accepted + details.get("rejected_prediction_tokens", 0)
    if "draft_n" in timings:  # llama-server
        drafted, accepted = timings["draft_n"], timings.get("draft_n_accepted", 0)
    return {
        "text": "".join(text),
        "completion_tokens": int(usage.get("completion_tokens", 0)),
        "first": first,
        "last": last,
        "draft_tokens": drafted or 0,
        "accepted_tokens": accepted or 0,
    }


def ask(
    base: str, model: str, content: str, tokens: int, streams: int, pid: int | None
) -> dict[str, Any]:
    """`streams` concurrent answers to the same request: decode tok/s (aggregate), guesses."""
    cpu_before = cpu_seconds(pid) if pid is not None else 0.0
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        answers = list(pool.map(lambda _: stream_one(base, model, content, tokens), range(streams)))
    cpu = cpu_seconds(pid) - cpu_before if pid is not None else None
    completion = sum(a["completion_tokens"] for a in answers)
    first = min(a["first"] for a in answers)
    last = max(a["last"] for a in answers)
    decoded = completion - (1 if streams == 1 else 0)
    drafted = sum(a["draft_tokens"] for a in answers)
    accepted = sum(a["accepted_tokens"] for a in answers)
    return {
        "text": answers[0]["text"],
        "texts_agree": all(a["text"] == answers[0]["text"] for a in answers),
        "completion_tokens": completion,
        "decode_tok_s": decoded / (last - first) if last > first else None,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance": accepted / drafted if drafted else None,
        "cpu_ms_per_token": 1000 * cpu / completion if cpu is not None and completion else None,
    }


def model_file(model: str) -> Path:
    from modelhost.residency.registry import ModelRegistry

    entry = ModelRegistry().resolve_argument(model)
    if entry is None:
        raise SystemExit(f"model {model} not found")
    return entry.path


def self_draft(file: Path, folder: Path) -> Path:
    """The model's own file under another name (a hard link, else a copy)."""
    link = folder / f"{file.stem}-draft.gguf"
    if not link.exists():
        try:
            os.link(file, link)
        except OSError:
            import shutil

            shutil.copyfile(file, link)
    return link


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "gemma-3-270m"])
    parser.add_argument(
        "--configs", nargs="+", choices=[*MODELHOST_CONFIGS, *LLAMA_CONFIGS],
        default=["none", "auto", "draft", "llama", "llama-ngram-simple", "llama-ngram-mod"],
    )  # fmt: skip
    parser.add_argument("--streams", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--port", type=int, default=8391)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--draft-model", default=None, metavar="ID_OR_PATH")
    parser.add_argument("--llama-server", type=Path, default=LLAMA_SERVER)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not args.llama_server.exists():
        args.configs = [c for c in args.configs if c not in LLAMA_CONFIGS]

    out = (
        args.out
        or Path("benchmarks/results") / f"speculation-{time.strftime('%Y%m%d-%H%M%S')}.json"
    )
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as scratch:
        for model in args.models:
            file = model_file(model)
            draft_given = args.draft_model
            args.draft_model = draft_given or str(self_draft(file, Path(scratch)))
            runs: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
            for _ in range(args.repeats):
                for config in args.configs:
                    command = server_command(config, model, file, args.port, args)
                    process = start_server(command, args.port)
                    pid = process.pid if config in MODELHOST_CONFIGS else None
                    try:
                        base = f"http://127.0.0.1:{args.port}"
                        stream_one(base, model, "Say hello.", 8)  # warm up
                        for name, content in REQUESTS.items():
                            for streams in args.streams:
                                found = ask(base, model, content, args.tokens, streams, pid)
                                runs.setdefault((config, name, streams), []).append(found)
                    finally:
                        stop_server(process)
                    # After each configuration: a run cut short keeps what it measured.
                    write(out, args, [*results, *summarise(model, runs)])
            args.draft_model = draft_given
            results += summarise(model, runs)
    print_table(results)
    write(out, args, results)
    print(f"wrote {out}")


def write(out: Path, args: Any, results: list[dict[str, Any]]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    draft = args.draft_model if args.draft_model and "-draft.gguf" not in args.draft_model else None
    body = {"tokens": args.tokens, "draft_model": draft or "self", "results": results}
    out.write_text(json.dumps(body, indent=2))


def summarise(
    model: str, runs: dict[tuple[str, str, int], list[dict[str, Any]]]
) -> list[dict[str, Any]]:
    """Each configuration's medians, its speed against modelhost without speculation and
    against its own server's plain configuration, and whether its answer is that one's."""
    medians = {key: median_of(found) for key, found in runs.items()}
    results = []
    for (config, name, streams), result in medians.items():
        result.update(model=model, config=config, request=name, streams=streams)
        result["repeats"] = len(runs[(config, name, streams)])
        result["vs_modelhost_none"] = ratio(result, medians.get(("none", name, streams)))
        plain = medians.get((BASELINE[config], name, streams))
        result["vs_plain"] = ratio(result, plain)
        result["same_answer"] = None if plain is None else result["text"] == plain["text"]
        results.append(result)
    return results


def ratio(result: dict[str, Any], baseline: dict[str, Any] | None) -> float | None:
    if baseline is None or not result["decode_tok_s"] or not baseline["decode_tok_s"]:
        return None
    return float(result["decode_tok_s"] / baseline["decode_tok_s"])


def print_table(results: list[dict[str, Any]]) -> None:
    header = f"{'model':22} {'request':6} {'n':>2} {'config':18} {'tok/s':>7} {'x none':>6} "
    header += f"{'x plain':>7} {'drafted':>7} {'accepted':>8} {'rate':>5} same"
    print(header)
    for r in results:
        rate = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "-"
        speed = f"{r['decode_tok_s']:.1f}" if r["decode_tok_s"] else "-"
        vs_none = f"{r['vs_modelhost_none']:.2f}" if r["vs_modelhost_none"] else "-"
        vs_plain = f"{r['vs_plain']:.2f}" if r["vs_plain"] else "-"
        print(
            f"{r['model']:22} {r['request']:6} {r['streams']:>2} {r['config']:18} {speed:>7} "
            f"{vs_none:>6} {vs_plain:>7} {r['draft_tokens']:>7} {r['accepted_tokens']:>8} "
            f"{rate:>5} {r['same_answer']}"
        )


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
