"""Prefill as the context grows (issue 49): prompt tokens a second at 1,200, 4k, 16k and 32k
tokens, modelhost's engine beside llama-server on the same GGUF file, one run.

    python benchmarks/long_prefill.py [MODEL] [--lengths 1200 4096 16384 32000] [--chunk 512]
        [--prompt-activations auto] [--llama-server PATH] [--no-llama | --no-modelhost]
        [--short-repeats 3] [--json PATH]

MODEL: a GGUF path or an embedded model's name (default gemma-3-270m, whose sliding-window
layers should cost their 512-token window, not the context). modelhost's engine runs in this
process (no HTTP: the prompt path alone, greedy, one token) with its window raised to hold the
longest prompt; llama-server (`-c 32768 -np 1`, every core) gets the same token ids through
`/completion` (`cache_prompt` false, `n_predict` 1), timed by its own `timings.prompt_ms`.
Every prompt starts with a different token: no prefix cache helps. 32k is 32,000 tokens, so the
prompt and its answer fit Gemma 3's 32,768. Reported: each side's prompt tok/s, their ratio, each
length's rate against modelhost's own at the shortest length (the issue's "no more than a third
below"), each server's process CPU seconds a prompt and their ratio (steadier than the wall
clock on a shared machine), and the load average around each side.
Writes JSON (default benchmarks/results/long-prefill-<time>.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
import torch
from prompt_path import measure_llama, modelhost_first_token, prompt_ids, repeats_of

from modelhost.engine.engine import Engine, EngineConfig, share_the_gil_with_the_engine
from modelhost.engine.prompt_activations import parse_prompt_activations
from modelhost.models.loading.loader import load_model, resolve

LLAMA_SERVER = Path("/work/llama-server/bin/llama-server")
LLAMA_CONTEXT = 32768
# Prompts this short take seconds and vary by 15-30% from one to the next on a shared machine
# (the 1B's 1,200 tokens: 149 and 197 tok/s in two runs of the same build): they are timed
# `--short-repeats` times on each side, the median kept; longer ones once.
SHORT_LIMIT = 4096


def measure_modelhost(name: str, args: argparse.Namespace) -> dict[str, Any]:
    model = load_model(name)
    cores = os.cpu_count() or 1
    config = EngineConfig(
        batch=4,
        max_num_batched_tokens=args.chunk,
        prompt_threads=cores,
        prompt_activations=parse_prompt_activations(args.prompt_activations),
        context_length=max(args.lengths) + 64,
        budgeted_window=True,  # the pool holds the whole window, as serve's budget sizes it
    )
    engine = Engine(model, config)
    result: dict[str, Any] = {"load_before": os.getloadavg()[0]}
    vocab = model.config.vocab_size
    try:
        # Warm-up at the shortest length: a worker's first long prompt pays its kernels'
        # first calls (bf16's oneDNN shapes), which the first measured length would carry.
        warm_up = prompt_ids(min(args.lengths), 0, vocab)
        asyncio.run(modelhost_first_token(engine, warm_up))
        variant = 0
        for length in args.lengths:
            repeats = repeats_of(length, args)
            times = []
            before = os.times()
            for _ in range(repeats):
                variant += 1
                ids = prompt_ids(length, variant, vocab)
                times.append(asyncio.run(modelhost_first_token(engine, ids)))
            after = os.times()
            cpu = ((after.user + after.system) - (before.user + before.system)) / repeats
            rate = length / statistics.median(times)
            result[f"prefill_{length}_tok_s"] = rate
            result[f"prefill_{length}_cpu_s"] = cpu
            print(f"  modelhost {length}: {rate:.1f} tok/s, CPU {cpu:.1f} s", flush=True)
    finally:
        engine.close()
    result["load_after"] = os.getloadavg()[0]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="gemma-3-270m")
    parser.add_argument("--lengths", nargs="+", type=int, default=[1200, 4096, 16384, 32000])
    parser.add_argument("--chunk", type=int, default=512, help="prompt tokens a step")
    parser.add_argument("--prompt-activations", choices=("auto", "8", "16", "bf16"), default="auto")
    parser.add_argument("--llama-server", type=Path, default=LLAMA_SERVER)
    parser.add_argument("--no-llama", action="store_true", help="modelhost alone")
    parser.add_argument("--no-modelhost", action="store_true", help="llama-server alone")
    parser.add_argument(
        "--short-repeats", type=int, default=3,
        help=f"times each prompt up to {SHORT_LIMIT} tokens is timed, the median kept",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    args.repeats, args.short_limit = 1, SHORT_LIMIT  # repeats_of's: longer prompts timed once
    share_the_gil_with_the_engine()  # as `modelhost serve` does where engines run
    torch.set_num_threads(max(1, (os.cpu_count() or 1) - 1))
    report: dict[str, Any] = {
        "meta": {"cores": os.cpu_count(), "args": {k: str(v) for k, v in vars(args).items()}},
        "modelhost": {} if args.no_modelhost else measure_modelhost(args.model, args),
    }
    if not args.no_llama:
        vocab = load_model(args.model).config.vocab_size
        llama_args = argparse.Namespace(
            llama_server=args.llama_server,
            prefill=args.lengths,
            repeats=args.repeats,
            short_repeats=args.short_repeats,
            short_limit=args.short_limit,
            short=12,
        )
        load_before = os.getloadavg()[0]
        try:
            path = Path(resolve(args.model).path)
            llama = measure_llama(path, vocab, llama_args, LLAMA_CONTEXT)
        except httpx.HTTPError as error:  # a prompt past the client's hour: keep ours
            llama = {"error": repr(error)}
        llama.update(load_before=load_before, load_after=os.getloadavg()[0])
        report["llama-server"] = llama
    ours, theirs = report["modelhost"], report.get("llama-server", {})
    shortest = min(args.lengths)
    print(f"\n{args.model}, prompt tok/s and CPU seconds a prompt (one run)")
    header = ("tokens", "modelhost", "CPU s", "llama-server", "CPU s", "ratio", "CPU ratio")
    print(" ".join(f"{name:>12}" for name in header), f"{'vs own short':>12}")
    for length in args.lengths:
        rate, cpu = f"prefill_{length}_tok_s", f"prefill_{length}_cpu_s"
        both = rate in ours and rate in theirs
        ratio = ours[rate] / theirs[rate] if both else None
        # The same prompt's CPU seconds, theirs over ours: >1 where modelhost spends less.
        cpu_ratio = theirs[cpu] / ours[cpu] if both and cpu in theirs else None
        own = ours[rate] / ours[f"prefill_{shortest}_tok_s"] if rate in ours else None
        report.setdefault("ratios", {})[str(length)] = {
            "to_llama": ratio,
            "to_llama_cpu": cpu_ratio,
            "to_own_short": own,
        }
        cells = (ours.get(rate), ours.get(cpu), theirs.get(rate), theirs.get(cpu), ratio,
                 cpu_ratio, own)  # fmt: skip
        print(
            f"{length:>12}",
            " ".join(f"{cell:>12.2f}" if cell is not None else f"{'-':>12}" for cell in cells),
        )
    report["meta"]["loadavg_end"] = os.getloadavg()
    out = args.json or Path(__file__).parent / "results" / f"long-prefill-{int(time.time())}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
