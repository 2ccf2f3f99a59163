"""LoRA adapters per row: decode tok/s of a batch whose rows run different adapters, against
the bare base (issue 47).

    .venv/bin/python benchmarks/lora.py [FILE.gguf] [--targets qv|all] [--rank 16]
        [--adapters 4] [--rows 8] [--tokens 64] [--repeats 3] [--threads N] [--out FILE]

FILE defaults to the synthetic Llama-shaped 1B Q4_K_M file (`synthetic_gguf.py --shape 1b
--type Q4_K_M`, /tmp/synth-models/1b-q4_k_m.gguf, written when missing). `--adapters` random
rank-`--rank` PEFT adapters of it are written to a temporary folder (q and v projections, or
all seven linear ones) and loaded beside it. The engine runs in process (no HTTP), greedy, EOS
ignored, no speculation, `--rows` rows at once of `--tokens` tokens each, in four mixes:

- `base`: every row the bare base (the one-call native decode path);
- `base, module path`: the same with that path off (what a step with an adapted row ran
  before its updates moved into the native call);
- `half adapted`: half the rows spread over the adapters, half the bare base;
- `all adapted`: every row an adapter's, the adapters taking turns.

Each figure: tokens after each row's first over the time from the last row's first token to the
last token (aggregate decode tok/s), the median of `--repeats` rounds, the mixes alternating
within a round. Then one decode step of the same `--rows` rows (64-token contexts) is timed
alone, without the engine's thread, `--steps` times a mix, the mixes alternating: its fastest
time, which a shared machine's other load disturbs least. Prints both tables and writes JSON
(default benchmarks/results/lora-<time>.json). The machines here are shared: compare the
ratios of one run, not figures across runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from modelhost.engine.engine import Engine, EngineConfig, set_threads
from modelhost.engine.sampling.sampling_params import SamplingParams
from modelhost.engine.scheduler import ScheduledRow, SchedulerOutput
from modelhost.engine.sequence import Sequence
from modelhost.models.adapters.adapter_set import AdapterSet
from modelhost.models.adapters.row_adapters import AdapterUse
from modelhost.models.loaded import LoadedModel
from modelhost.models.loading.loader import load_model

sys.path.append(str(Path(__file__).resolve().parent))  # its sibling modules, shadowing nothing
from idle_footprint import FILE_1B, ensure_1b  # noqa: E402

TARGETS = {
    "qv": ("self_attn.q_proj", "self_attn.v_proj"),
    "all": tuple(f"self_attn.{p}_proj" for p in "qkvo")
    + tuple(f"mlp.{p}_proj" for p in ("gate", "up", "down")),
}
MIXES = ("base", "base, module path", "half adapted", "all adapted")


def write_adapter(model: LoadedModel, folder: Path, targets: str, rank: int, seed: int) -> None:
    """A random PEFT adapter of `model` (B non-zero, so every update is computed and added)."""
    config = model.config
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes = {
        "q_proj": (config.hidden_size, q),
        "k_proj": (config.hidden_size, kv),
        "v_proj": (config.hidden_size, kv),
        "o_proj": (q, config.hidden_size),
        "gate_proj": (config.hidden_size, config.intermediate_size),
        "up_proj": (config.hidden_size, config.intermediate_size),
        "down_proj": (config.intermediate_size, config.hidden_size),
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for target in TARGETS[targets]:
            fan_in, fan_out = shapes[target.rpartition(".")[2]]
            stem = f"base_model.model.model.layers.{layer}.{target}"
            a = torch.randn(rank, fan_in, generator=generator) / fan_in**0.5
            tensors[f"{stem}.lora_A.weight"] = a
            tensors[f"{stem}.lora_B.weight"] = (
                torch.randn(fan_out, rank, generator=generator) * 0.01
            )
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    modules = sorted({t.rpartition(".")[2] for t in TARGETS[targets]})
    config_json = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": modules, "bias": "none"}  # fmt: skip
    (folder / "adapter_config.json").write_text(json.dumps(config_json))


def prompt_of(model: LoadedModel, row: int) -> list[int]:
    """A 16-token prompt of its own (no prefix shared between rows or rounds)."""
    return model.tokenizer.encode(f"{row} The quick brown fox jumps over the lazy dog again.")[:16]


async def decode_rate(
    engine: Engine, model: LoadedModel, uses: list[AdapterUse | None], tokens: int, round_: int
) -> float:
    async def one(row: int, use: AdapterUse | None) -> tuple[float, float]:
        params = SamplingParams(
            temperature=0.0, max_tokens=tokens, ignore_eos=True, speculate=False, adapter=use
        )
        first = None
        async for event in engine.submit(prompt_of(model, 1000 * round_ + row), params):
            if first is None and event.token_ids:
                first = time.perf_counter()
        return first or time.perf_counter(), time.perf_counter()

    times = await asyncio.gather(*(one(row, use) for row, use in enumerate(uses)))
    decoding = max(end for _, end in times) - max(first for first, _ in times)
    return len(uses) * (tokens - 1) / decoding


def mix_uses(mix: str, rows: int, uses: list[AdapterUse]) -> list[AdapterUse | None]:
    if mix.startswith("base"):
        return [None] * rows
    if mix == "half adapted":
        return [uses[row // 2 % len(uses)] if row % 2 else None for row in range(rows)]
    return [uses[row % len(uses)] for row in range(rows)]


async def run(model: LoadedModel, adapters: AdapterSet, args: argparse.Namespace) -> dict:
    engine = Engine(model, EngineConfig(batch=args.rows, max_num_batched_tokens=512))
    network: Any = model.network
    uses = [adapters.use(name) for name in adapters.names()]
    try:
        await decode_rate(engine, model, mix_uses("all adapted", args.rows, uses), 4, 0)  # warm
        rates: dict[str, list[float]] = {mix: [] for mix in MIXES}
        for round_ in range(1, args.repeats + 1):
            for mix in MIXES:
                network.fuse_decode = mix != "base, module path"
                chosen = mix_uses(mix, args.rows, uses)
                rate = await decode_rate(engine, model, chosen, args.tokens, round_)
                rates[mix].append(rate)
                print(f"  round {round_} {mix}: {rate:.1f} tok/s", file=sys.stderr)
        network.fuse_decode = True
        return {mix: statistics.median(values) for mix, values in rates.items()} | {"runs": rates}
    finally:
        engine.close()


def step_times(
    model: LoadedModel, adapters: AdapterSet, args: argparse.Namespace
) -> dict[str, float]:
    """The fastest of `--steps` decode steps of each mix, in ms (runner.execute alone)."""
    engine = Engine(model, EngineConfig(batch=args.rows))
    network: Any = model.network
    uses = [adapters.use(name) for name in adapters.names()]
    try:
        batches = {}
        for number, mix in enumerate(MIXES):
            rows = []
            for row, use in enumerate(mix_uses(mix, args.rows, uses)):
                ids = [100 + number * args.rows + row + i for i in range(64)]
                seq = Sequence.from_prompt(row, ids, SamplingParams(adapter=use))
                engine.block_manager.append_slots(seq, len(ids) + 1)
                seq.token_ids.append(ids[-1])
                rows.append(ScheduledRow(seq, len(ids), 1, True))
            batches[mix] = SchedulerOutput(rows=rows)
        times: dict[str, list[float]] = {mix: [] for mix in MIXES}
        for _ in range(args.steps):
            for mix, batch in batches.items():
                network.fuse_decode = mix != "base, module path"
                started = time.perf_counter()
                engine.runner.execute(batch)
                times[mix].append((time.perf_counter() - started) * 1000)
        network.fuse_decode = True
        return {mix: min(values) for mix, values in times.items()}
    finally:
        engine.close()


def format_table(report: dict[str, Any]) -> str:
    medians = report["decode_tok_s"]
    base = medians["base"]
    lines = [
        f"{report['file']} ({report['targets']}, rank {report['rank']}, "
        f"{report['adapters']} adapters, {report['adapter_bytes'] / 1e6:.1f} MB), "
        f"{report['rows']} rows x {report['tokens']} tokens, median of {report['repeats']}",
        "",
        "| mix | decode tok/s | vs base |",
        "|---|---|---|",
    ]
    for mix in MIXES:
        lines.append(f"| {mix} | {medians[mix]:.1f} | {medians[mix] / base:.2f}x |")
    steps = report["step_ms"]
    lines += [
        "",
        f"one decode step of {report['rows']} rows, fastest of {report['steps']}:",
        "",
        "| mix | ms | base's time / this |",
        "|---|---|---|",
    ]
    for mix in MIXES:
        lines.append(f"| {mix} | {steps[mix]:.1f} | {steps['base'] / steps[mix]:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("file", nargs="?", type=Path, default=FILE_1B)
    parser.add_argument("--targets", choices=sorted(TARGETS), default="qv")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    set_threads(args.threads)
    path = ensure_1b(args.file) if args.file == FILE_1B else args.file
    model = load_model(str(path))
    adapters = AdapterSet(model)
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as scratch:
        for index in range(args.adapters):
            folder = Path(scratch) / f"adapter-{index}"
            write_adapter(model, folder, args.targets, args.rank, seed=index)
            adapters.add(f"adapter-{index}", str(folder))
        medians = asyncio.run(run(model, adapters, args))
        steps = step_times(model, adapters, args)
    runs = medians.pop("runs")
    report = {
        "file": str(path),
        "targets": args.targets,
        "rank": args.rank,
        "adapters": args.adapters,
        "adapter_bytes": adapters.loaded_bytes(),
        "rows": args.rows,
        "tokens": args.tokens,
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "steps": args.steps,
        "decode_tok_s": medians,
        "runs": runs,
        "step_ms": steps,
    }
    print(format_table(report))
    out = args.out or Path(__file__).with_name("results") / f"lora-{int(time.time())}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
