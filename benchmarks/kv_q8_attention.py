"""A decode step's attention alone, over an fp16 and an 8-bit KV pool (`--kv-cache q8`).

    .venv/bin/python benchmarks/kv_q8_attention.py [--repeats 200] [--out FILE]

Times the native paged attention (norm-free, one query a row) over random keys and values in
SmolLM2-135M's heads (9 over 3 KV heads of 64) and Gemma 3 270M's (4 over 1 of 256), at 1 and
8 rows and 1024 and 4096 tokens of context, the two pools interleaved call by call; each figure
is the fastest of `--repeats` calls (a loaded machine's preempted calls only ever add time).
Prints a table and writes JSON (default benchmarks/results/kv-q8-attention-<time>.json).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from modelhost.models import kv_q8
from modelhost.models.kernels import native
from modelhost.models.networks.layers import Rotary

SHAPES = {"smollm2-135m": (9, 3, 64), "gemma-3-270m": (4, 1, 256)}  # heads, KV heads, dim
STEPS = [(1, 1024), (8, 1024), (8, 4096)]  # rows, context
BLOCK_SIZE = 16


def fastest_calls(
    kernels: native.Kernels, shape: tuple[int, int, int], rows: int, context: int, repeats: int
) -> dict[str, float]:
    """The fastest call's seconds over each pool, f16 and q8."""
    heads, kv_heads, dim = shape
    per_row = context // BLOCK_SIZE
    tables = torch.tensor([[1 + r + rows * j for j in range(per_row)] for r in range(rows)])
    positions = torch.full((rows,), context - 1)
    slots = tables[:, -1] * BLOCK_SIZE + (context - 1) % BLOCK_SIZE
    kv = torch.randn((1 + rows * per_row) * BLOCK_SIZE, 2, kv_heads, dim)
    pools = {"f16": kv.half(), "q8": kv_q8.quantize(kv)}
    rope = Rotary(dim, 10_000.0).cos_sin(positions, torch.float32)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim)
    best = dict.fromkeys(pools, float("inf"))
    for _ in range(repeats):
        for name, pool in pools.items():
            work = qkv.clone()
            start = time.perf_counter()
            kernels.paged_attention(
                work, heads, kv_heads, None, rope, pool, slots, tables, BLOCK_SIZE, positions,
                0, dim**-0.5,
            )  # fmt: skip
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    kernels = native.kernels()
    if kernels is None:
        raise SystemExit("the native kernels do not run here")
    torch.manual_seed(0)
    results: dict[str, dict[str, float]] = {}
    print(f"{'shape':<14} {'rows':>4} {'context':>7} {'f16 us':>8} {'q8 us':>8} {'q8 / f16':>8}")
    for model, shape in SHAPES.items():
        for rows, context in STEPS:
            best = fastest_calls(kernels, shape, rows, context, args.repeats)
            ratio = best["q8"] / best["f16"]
            results[f"{model}:rows={rows}:context={context}"] = {
                "f16_us": best["f16"] * 1e6,
                "q8_us": best["q8"] * 1e6,
                "q8_over_f16": ratio,
            }
            f16_us, q8_us = best["f16"] * 1e6, best["q8"] * 1e6
            print(f"{model:<14} {rows:>4} {context:>7} {f16_us:>8.0f} {q8_us:>8.0f} {ratio:>7.2f}x")
    meta = {"repeats": args.repeats, "threads": kernels.threads, "loadavg_end": os.getloadavg()}
    stamp = int(time.time())
    out = args.out or Path(__file__).parent / "results" / f"kv-q8-attention-{stamp}.json"
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
