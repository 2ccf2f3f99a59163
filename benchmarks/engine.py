"""Engine throughput: prefill, single-stream decode and aggregate decode at 1/4/8/16 streams.

    .venv/bin/python benchmarks/engine.py [--models smollm2-135m-instruct gemma-3-270m]
                                          [--modes none auto] [--streams 1 4 8 16]
                                          [--threads N] [--prompt-threads N] [--tokens 128]
                                          [--kv-cache f16 q8] [--out FILE]

Runs the engine directly (no HTTP), greedy, EOS ignored so every stream makes its full length.
Each `--modes` entry loads the model with that CPU linear mode (loading/quant.py); with several,
the table adds each mode's ratio to the first, measured in the same run; each `--kv-cache`
entry holds the KV pool in that format (`serve --kv-cache`), with the same ratios to the first.
Prints a table and writes JSON (default benchmarks/results/engine-<time>.json). These machines
are shared and noisy: compare ratios within one run, not figures across runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

import torch

from modelhost.engine.engine import Engine, EngineConfig, share_the_gil_with_the_engine
from modelhost.engine.kv.kv_format import KV_FORMATS, KVFormat
from modelhost.engine.sampling.sampling_params import SamplingParams
from modelhost.models.loaded import LoadedModel
from modelhost.models.loading.loader import load_model
from modelhost.models.modes import MODES

FILLER = "The quick brown fox jumps over the lazy dog while the sun sets slowly in the west. "


def prompt_of(model: LoadedModel, num_tokens: int, variant: int) -> list[int]:
    """A `num_tokens` prompt; `variant` changes its first token so no prefix cache applies."""
    ids = model.tokenizer.encode(f"{variant} " + FILLER * (num_tokens // 8 + 1))
    return ids[:num_tokens]


async def timed_stream(engine: Engine, prompt: list[int], max_tokens: int) -> tuple[float, float]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    first = None
    async for event in engine.submit(prompt, params):
        if first is None and event.token_ids:
            first = time.perf_counter() - started
    return first or 0.0, time.perf_counter() - started


async def measure(
    model: LoadedModel, args: argparse.Namespace, kv_cache: KVFormat = "f16"
) -> dict[str, float]:
    config = EngineConfig(
        batch=16,
        max_num_batched_tokens=512,
        prompt_threads=args.prompt_threads,
        kv_cache=kv_cache,
    )
    engine = Engine(model, config)
    try:
        await timed_stream(engine, prompt_of(model, 32, 0), 4)  # warm-up
        prefill = []
        for variant in range(1, 4):
            first, _ = await timed_stream(engine, prompt_of(model, 512, variant), 1)
            prefill.append(512 / first)
        decode = []
        for variant in range(4, 6):
            first, total = await timed_stream(engine, prompt_of(model, 16, variant), args.tokens)
            decode.append((args.tokens - 1) / (total - first))
        result = {
            "prefill_tok_s": statistics.median(prefill),
            "decode_tok_s": statistics.median(decode),
        }
        for streams in args.streams:
            prompts = [prompt_of(model, 16, 100 * streams + i) for i in range(streams)]
            started = time.perf_counter()
            await asyncio.gather(*(timed_stream(engine, p, args.tokens) for p in prompts))
            result[f"aggregate_{streams}_tok_s"] = (
                streams * args.tokens / (time.perf_counter() - started)
            )
        return result
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "gemma-3-270m"])
    parser.add_argument("--modes", nargs="+", default=[None], choices=MODES)
    parser.add_argument("--streams", nargs="+", type=int, default=[1, 4, 8, 16])
    # `modelhost serve`'s defaults: PyTorch on all cores but one, prompt steps and the native
    # kernels on all. PyTorch on every core too made SmolLM2's one-row decode 88 tok/s
    # against 144 (AMD EPYC, 2 cores): its idle threads spin while the kernels' threads run.
    cores = os.cpu_count() or 1
    parser.add_argument("--threads", type=int, default=max(1, cores - 1))
    parser.add_argument("--prompt-threads", type=int, default=cores)
    parser.add_argument("--tokens", type=int, default=128, help="generated tokens per stream")
    parser.add_argument("--kv-cache", nargs="+", default=["f16"], choices=KV_FORMATS)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    share_the_gil_with_the_engine()  # as `modelhost serve` does where engines run
    torch.set_num_threads(args.threads)
    results: dict[str, dict[str, float]] = {}
    bases: dict[str, str] = {}  # each row's first row of the same model, its ratios' base
    for name in args.models:
        for mode in args.modes:
            model = load_model(name, quantize=mode)
            for kv_cache in args.kv_cache:
                key = name if mode is None else f"{name}:{mode}"
                key += "" if len(args.kv_cache) == 1 else f":kv-{kv_cache}"
                bases[key] = bases.get(name, key)
                bases.setdefault(name, key)
                figures = asyncio.run(measure(model, args, kv_cache))
                results[key] = {"load_s": model.load_seconds, **figures}
            del model
    columns = ["load_s", "prefill_tok_s", "decode_tok_s"] + [
        f"aggregate_{n}_tok_s" for n in args.streams
    ]
    print(f"{'model':<30}" + "".join(f"{c.removesuffix('_tok_s'):>14}" for c in columns))
    for key, row in results.items():
        print(f"{key:<30}" + "".join(f"{row[c]:>14.1f}" for c in columns))
        base = results[bases[key]]
        if row is not base:
            ratios = "".join(f"{row[c] / base[c]:>13.2f}x" for c in columns)
            print(f"{'  ratio to ' + bases[key]:<30}" + ratios)
    out = args.out or Path(__file__).parent / "results" / f"engine-{int(time.time())}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "threads": args.threads,
        "prompt_threads": args.prompt_threads,
        "tokens": args.tokens,
        "torch": torch.__version__,
        "loadavg_end": os.getloadavg(),
    }
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
