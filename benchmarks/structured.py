"""What structured output costs a decode step: tok/s of a schema-bound answer against an
unconstrained one, at 1 and 8 streams.

    .venv/bin/python benchmarks/structured.py [--model smollm2-135m-instruct] [--streams 1 8]
                                              [--tokens 128] [--repeats 3] [--out FILE]

Runs the engine directly (no HTTP), greedy. Three sides, alternated run by run (medians):
`free` (no grammar, EOS ignored so every stream makes its full length), `masked` (the
grammar's token mask only, as before closing existed) and `closing` (the mask and the
budget-aware closing, as served). The schema is open-ended (a list of places with free-text
notes), so a constrained stream also writes until its budget and then closes. tok/s counts the
tokens each stream actually made after its first (prefill is left out). Prints a table and
writes JSON (default benchmarks/results/structured-<time>.json).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

from modelhost.engine.engine import Engine, EngineConfig, share_the_gil_with_the_engine
from modelhost.engine.sampling.sampling_params import SamplingParams
from modelhost.inference.contracts import GrammarSpec
from modelhost.inference.grammars.compiler import ModelGrammars
from modelhost.models.loaded import LoadedModel
from modelhost.models.loading.loader import load_model

SCHEMA = {
    "type": "object",
    "properties": {
        "places": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "nights": {"type": "integer"}},
                "required": ["city", "nights"],
            },
        },
        "notes": {"type": "string"},
    },
    "required": ["places", "notes"],
}
ASK = "Plan a long trip through many European cities, as JSON."
SIDES = ("free", "masked", "closing")


def params_for(model: LoadedModel, tokens: int) -> dict[str, SamplingParams]:
    grammars = ModelGrammars(model)
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    compiled = grammars.compile_sync(spec)
    closing = grammars.closing_sync(spec, compiled)
    assert closing is not None, "the benchmark schema must have a closing plan"
    base = SamplingParams(temperature=0.0, max_tokens=tokens)
    return {
        "free": dataclasses.replace(base, ignore_eos=True),
        "masked": dataclasses.replace(base, grammar=compiled),
        "closing": dataclasses.replace(base, grammar=compiled, grammar_close=closing.plan),
    }


async def stream_tokens(
    engine: Engine, prompt: list[int], params: SamplingParams
) -> tuple[int, float, float]:
    """(tokens made, when the first came, when the last came)."""
    made, first, last = 0, 0.0, 0.0
    async for event in engine.submit(prompt, params):
        if event.token_ids:
            last = time.perf_counter()
            first = first or last
            made += len(event.token_ids)
    return made, first, last


async def run_side(
    engine: Engine, prompts: list[list[int]], params: SamplingParams
) -> tuple[float, int]:
    """Decode tok/s (the tokens after each stream's first, from the earliest first token to
    the last token: prefill left out) and the tokens made."""
    streams = await asyncio.gather(*(stream_tokens(engine, p, params) for p in prompts))
    made = sum(s[0] for s in streams)
    start = min(s[1] for s in streams)
    end = max(s[2] for s in streams)
    return (made - len(streams)) / max(end - start, 1e-9), made


async def measure(model: LoadedModel, args: argparse.Namespace) -> dict[str, Any]:
    engine = Engine(model, EngineConfig(batch=max(args.streams)))
    sides = params_for(model, args.tokens)
    results: dict[str, Any] = {}
    try:
        prompt = model.tokenizer.encode_chat([{"role": "user", "content": ASK}])
        await stream_tokens(engine, prompt, sides["closing"])  # warm-up, grammar imports
        for streams in args.streams:
            runs: dict[str, list[float]] = {side: [] for side in SIDES}
            made: dict[str, int] = {}
            for repeat in range(args.repeats):
                for side in SIDES:
                    # A different user turn a run, so that no prefix cache favours one side.
                    prompts = [
                        model.tokenizer.encode_chat(
                            [{"role": "user", "content": f"({repeat}.{i}) {ASK}"}]
                        )
                        for i in range(streams)
                    ]
                    tok_s, made[side] = await run_side(engine, prompts, sides[side])
                    runs[side].append(tok_s)
            row = {side: statistics.median(runs[side]) for side in SIDES}
            for side in SIDES:
                row[f"{side}_tokens"] = made[side]
            row["closing_vs_free"] = row["closing"] / row["free"]
            row["closing_vs_masked"] = row["closing"] / row["masked"]
            results[f"{streams}_streams"] = row
    finally:
        engine.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    share_the_gil_with_the_engine()
    model = load_model(args.model)
    results = asyncio.run(measure(model, args))
    print(f"{args.model}: decode tok/s, {args.tokens}-token budget, medians of {args.repeats}")
    print(f"{'streams':>8} {'free':>8} {'masked':>8} {'closing':>8} {'vs free':>8} {'vs mask':>8}")
    for key, row in results.items():
        print(
            f"{key.split('_')[0]:>8} {row['free']:8.1f} {row['masked']:8.1f} "
            f"{row['closing']:8.1f} {row['closing_vs_free']:8.2f} {row['closing_vs_masked']:8.2f}"
        )
    out = args.out or Path("benchmarks/results") / f"structured-{int(time.time())}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": args.model, "tokens": args.tokens, **results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
