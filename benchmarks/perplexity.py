"""Quality of the CPU linear modes (models/loading/quant.py): perplexity and greedy agreement.

    .venv/bin/python benchmarks/perplexity.py [--models ...] [--modes none int8 auto int4]
    .venv/bin/python benchmarks/perplexity.py --modes auto --prompt-activations 16 8
    .venv/bin/python benchmarks/perplexity.py --modes auto --kv-cache f16 q8

For each model and mode: perplexity of a fixed public-domain text (one pass through the
model's own forward and paged cache, every position computed as generated tokens are), and
greedy continuations of the engine's correctness prompts compared token by token with mode
`none` (fp32, the reference maths). Prints a table and writes JSON (default
benchmarks/results/perplexity-<time>.json).

With `--prompt-activations`, each mode also runs at those bits of the prompt rows whose logits
nobody reads (`modelhost serve --prompt-activations`): the text is scored in windows of
WINDOW positions, each predicted from a context whose tokens before the window ran at those
bits and whose window rows (the ones scored) at 16, as a prompt's last token is; and once with
every row at 8 bits, the LM head's included (llama.cpp's way, a bound). The greedy
continuations then come from an engine with that setting (the prompts' tokens before their last
at those bits), compared with the mode's own 16-bit ones.

With `--kv-cache`, each mode also runs with those KV formats (`modelhost serve --kv-cache`): the
text's perplexity with its keys and values read back from that cache (each position attends to
the cached form of every earlier one, its own included), and greedy continuations against the
mode's 16-bit ones.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from pathlib import Path

import torch

from modelhost.engine.engine import Engine, EngineConfig, share_the_gil_with_the_engine
from modelhost.engine.kv.kv_format import KV_FORMATS, KVFormat
from modelhost.engine.prompt_activations import parse_prompt_activations
from modelhost.engine.sampling.sampling_params import SamplingParams
from modelhost.engine.scheduler import ScheduledRow, SchedulerOutput
from modelhost.engine.sequence import Sequence
from modelhost.models.loaded import LoadedModel
from modelhost.models.loading.loader import load_model
from modelhost.models.loading.quant import describe
from modelhost.models.modes import MODES

TEXT = """\
It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of
foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of
Light, it was the season of Darkness, it was the spring of hope, it was the winter of despair, we
had everything before us, we had nothing before us, we were all going direct to Heaven, we were all
going direct the other way - in short, the period was so far like the present period, that some of
its noisiest authorities insisted on its being received, for good or for evil, in the superlative
degree of comparison only.

Four score and seven years ago our fathers brought forth on this continent, a new nation,
conceived in Liberty, and dedicated to the proposition that all men are created equal. Now we are
engaged in a great civil war, testing whether that nation, or any nation so conceived and so
dedicated, can long endure. We are met on a great battle-field of that war. We have come to
dedicate a portion of that field, as a final resting place for those who here gave their lives
that that nation might live. It is altogether fitting and proper that we should do this.

When in the Course of human events, it becomes necessary for one people to dissolve the political
bands which have connected them with another, and to assume among the powers of the earth, the
separate and equal station to which the Laws of Nature and of Nature's God entitle them, a decent
respect to the opinions of mankind requires that they should declare the causes which impel them
to the separation.

Call me Ishmael. Some years ago - never mind how long precisely - having little or no money in my
purse, and nothing particular to interest me on shore, I thought I would sail about a little and
see the watery part of the world. It is a way I have of driving off the spleen, and regulating the
circulation. Whenever I find myself growing grim about the mouth; whenever it is a damp, drizzly
November in my soul; whenever I find myself involuntarily pausing before coffin warehouses, and
bringing up the rear of every funeral I meet; then, I account it high time to get to sea as soon
as I can.

Photosynthesis is the process by which green plants and some other organisms use sunlight to
synthesize foods from carbon dioxide and water. Photosynthesis in plants generally involves the
green pigment chlorophyll and generates oxygen as a byproduct. The light reactions capture energy
from sunlight, which the plant stores in the chemical bonds of glucose and other sugars.
"""

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
    "My favourite book is",
    "In 1969, the first humans",
    "A good breakfast includes",
    "The history of the Roman Empire begins",
]


def prompt_logits(
    model: LoadedModel, ids: list[int], coarse: bool = False, kv_cache: KVFormat = "f16"
) -> torch.Tensor:
    """Logits at every position of one forward; with `coarse` every row at 8 bits (the LM
    head's included); keys and values held in the `kv_cache` format."""
    config = EngineConfig(batch=1, max_num_batched_tokens=len(ids), kv_cache=kv_cache)
    engine = Engine(model, config)
    try:
        seq = Sequence.from_prompt(0, ids, SamplingParams())
        engine.block_manager.append_slots(seq, len(ids))
        batch = engine.runner.build_batch(
            SchedulerOutput(rows=[ScheduledRow(seq, 0, len(ids), True)])
        )
        batch.logits_index = torch.arange(len(ids))
        if coarse:
            batch.coarse_rows = torch.ones(len(ids), dtype=torch.bool)
        return model.network(batch, engine.runner.kv)
    finally:
        engine.close()


WINDOW = 128  # positions scored together in the prompt-activation perplexity


def windowed_logits(model: LoadedModel, ids: list[int], context: int | str) -> torch.Tensor:
    """Logits at every position but the last, window by window: positions [a, a + WINDOW)
    from one forward over ids[: a + WINDOW] whose rows before a are coarse (8-bit
    activations, or bf16) where `context` is 8 (or "bf16"), the window's rows at 16 bits."""
    engine = Engine(model, EngineConfig(batch=1, max_num_batched_tokens=len(ids)))
    try:
        out = []
        for a in range(0, len(ids) - 1, WINDOW):
            end = min(a + WINDOW, len(ids) - 1)
            seq = Sequence.from_prompt(a, ids[:end], SamplingParams())
            engine.block_manager.append_slots(seq, end)
            batch = engine.runner.build_batch(
                SchedulerOutput(rows=[ScheduledRow(seq, 0, end, True)])
            )
            batch.logits_index = torch.arange(a, end)
            if context != 16 and a > 0:
                batch.coarse_rows = batch.positions < a
                batch.coarse_bf16 = context == "bf16"
            out.append(model.network(batch, engine.runner.kv))
            engine.block_manager.free(seq)
        return torch.cat(out)
    finally:
        engine.close()


def prompt_perplexity(model: LoadedModel, bits: int | str) -> float:
    ids = model.tokenizer.encode(TEXT)
    logits = windowed_logits(model, ids, bits)
    nll = torch.nn.functional.cross_entropy(logits.float(), torch.tensor(ids[1:]))
    return math.exp(nll.item())


def all_coarse_perplexity(model: LoadedModel) -> float:
    """Every row of the text at 8 bits, the LM head's included."""
    ids = model.tokenizer.encode(TEXT)
    logits = prompt_logits(model, ids, coarse=True)
    nll = torch.nn.functional.cross_entropy(logits[:-1].float(), torch.tensor(ids[1:]))
    return math.exp(nll.item())


def perplexity(model: LoadedModel, kv_cache: KVFormat = "f16") -> tuple[float, int]:
    ids = model.tokenizer.encode(TEXT)
    logits = prompt_logits(model, ids, kv_cache=kv_cache)
    nll = torch.nn.functional.cross_entropy(logits[:-1].float(), torch.tensor(ids[1:]))
    return math.exp(nll.item()), len(ids)


def greedy(
    model: LoadedModel, num_tokens: int, bits: int | str = 16, kv_cache: KVFormat = "f16"
) -> list[list[int]]:
    async def run() -> list[list[int]]:
        engine = Engine(model, EngineConfig(batch=8, prompt_activations=bits, kv_cache=kv_cache))
        params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
        try:
            out = []
            for prompt in PROMPTS:  # one at a time: no batch effects in the comparison
                ids = model.tokenizer.encode(prompt)
                events = [event async for event in engine.submit(ids, params)]
                out.append([t for event in events for t in event.token_ids])
            return out
        finally:
            engine.close()

    return asyncio.run(run())


def agreement(ours: list[list[int]], reference: list[list[int]]) -> tuple[int, float]:
    """Prompts whose continuation is identical, and the mean tokens before the first difference."""
    same = sum(a == b for a, b in zip(ours, reference, strict=True))
    prefix = []
    for a, b in zip(ours, reference, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        prefix.append(n)
    return same, sum(prefix) / len(prefix)


def by_bits(
    model: LoadedModel, bits: list[int | str], tokens: int, reference: list[list[int]]
) -> dict[int | str, dict]:
    """The windowed perplexity and greedy agreement (with the mode's 16-bit continuations) at
    each of `bits` (or "bf16": its greedy prompts, under 512 tokens, stay at 16 bits), and at 8
    the perplexity with every row at 8 bits."""
    figures: dict[int | str, dict] = {}
    for b in bits:
        same, prefix = agreement(greedy(model, tokens, b), reference)
        figures[b] = {
            "windowed_perplexity": prompt_perplexity(model, b),
            "greedy_identical": same,
            "mean_tokens_before_divergence": prefix,
        }
        if b == 8:
            figures[b]["all_rows_perplexity"] = all_coarse_perplexity(model)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "gemma-3-270m"])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--prompt-activations", nargs="+", type=parse_prompt_activations,
        choices=(8, 16, "bf16"), default=[],
        help="also score each mode with these bits of unread prompt rows (see above)",
    )  # fmt: skip
    parser.add_argument(
        "--kv-cache", nargs="+", choices=KV_FORMATS, default=[],
        help="also score each mode with its keys and values in these KV formats",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    share_the_gil_with_the_engine()  # as `modelhost serve` does where engines run
    torch.set_num_threads(args.threads)
    results: dict[str, dict[str, dict]] = {}
    for name in args.models:
        reference = None
        for mode in ["none"] + [m for m in args.modes if m != "none"]:
            model = load_model(name, quantize=mode)
            ppl, num_tokens = perplexity(model)
            continuations = greedy(model, args.tokens)
            if reference is None:
                reference = continuations
            same, prefix = agreement(continuations, reference)
            results.setdefault(name, {})[mode] = {
                "perplexity": ppl,
                "text_tokens": num_tokens,
                "greedy_identical": same,
                "greedy_prompts": len(PROMPTS),
                "mean_tokens_before_divergence": prefix,
                "weights_mb": model.weights_bytes / 1e6,
                "linears": describe(model.network),
            }
            if args.prompt_activations:
                results[name][mode]["prompt_activations"] = by_bits(
                    model, args.prompt_activations, args.tokens, continuations
                )
            for kv_cache in args.kv_cache:
                kv_ppl, _ = perplexity(model, kv_cache)
                same, prefix = agreement(
                    greedy(model, args.tokens, kv_cache=kv_cache), continuations
                )
                results[name][mode].setdefault("kv_cache", {})[kv_cache] = {
                    "perplexity": kv_ppl,
                    "change": kv_ppl / ppl - 1,
                    "greedy_identical": same,
                    "mean_tokens_before_divergence": prefix,
                }
            del model
    print(f"{'model':<24}{'mode':>6}{'ppl':>10}{'greedy same':>13}{'agree tok':>11}{'MB':>9}")
    for name, modes in results.items():
        for mode, row in modes.items():
            print(
                f"{name:<24}{mode:>6}{row['perplexity']:>10.3f}"
                f"{row['greedy_identical']:>9}/{row['greedy_prompts']:<3}"
                f"{row['mean_tokens_before_divergence']:>11.1f}{row['weights_mb']:>9.0f}"
            )
    for name, modes in results.items():
        for mode, row in modes.items():
            for bits, figures in row.get("prompt_activations", {}).items():
                print(
                    f"{name:<24}{mode:>6} prompt rows at {bits!s:>4}: windowed ppl "
                    f"{figures['windowed_perplexity']:.3f}, greedy same "
                    f"{figures['greedy_identical']}/{len(PROMPTS)} "
                    f"({figures['mean_tokens_before_divergence']:.1f} tokens agree)"
                    + (
                        f", every row at 8 bits: ppl {figures['all_rows_perplexity']:.3f}"
                        if "all_rows_perplexity" in figures
                        else ""
                    )
                )
    for name, modes in results.items():
        for mode, row in modes.items():
            for kv_cache, figures in row.get("kv_cache", {}).items():
                print(
                    f"{name:<24}{mode:>6} KV {kv_cache}: ppl {figures['perplexity']:.3f} "
                    f"({figures['change']:+.3%} against 16-bit), greedy same "
                    f"{figures['greedy_identical']}/{len(PROMPTS)} "
                    f"({figures['mean_tokens_before_divergence']:.1f} tokens agree)"
                )
    out = args.out or Path(__file__).parent / "results" / f"perplexity-{int(time.time())}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"tokens": args.tokens, "threads": args.threads, "torch": torch.__version__}
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
