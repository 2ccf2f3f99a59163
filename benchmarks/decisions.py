"""Typed-decision latency: a 3-question request on a ~300-token state, against generating the
same answers as JSON text.

    .venv/bin/python benchmarks/decisions.py [--model smollm2-135m-instruct] [--threads N]
                                             [--repeats 5] [--json-tokens 48] [--out FILE]

Three timings per repeat, each on a state no earlier request has seen (its first word varies):
- decisions, cold state: the state's prefill, then one step for the three questions;
- decisions, warm state: the same request again, the state now in the prefix cache;
- JSON text: the state and the three questions in one chat prompt, greedy, up to
  `--json-tokens` tokens (EOS honoured: the model stops when its JSON is done).
Prints medians and writes JSON (default benchmarks/results/decisions-<time>.json). Shared,
noisy machines: compare the ratios within one run.
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
from modelhost.engine.sampling.sampling_params import SamplingParams
from modelhost.inference.decision_prompt import DecisionQuestion, DecisionRequest, Option
from modelhost.inference.decisions import decide
from modelhost.inference.stage import InferenceStage
from modelhost.models.loaded import LoadedModel
from modelhost.models.loading.loader import load_model

TICKET = (
    "Customer wrote: I ordered a pair of running shoes three weeks ago and the parcel still has "
    "not arrived. My card was charged twice for the same order. I have emailed twice and nobody "
    "answered. I want a refund for the duplicate charge today. "
)
QUESTIONS = (
    DecisionQuestion("binary", "refund", "Does the customer ask for money back?",
                     (Option("true"), Option("false"))),
    DecisionQuestion("choice", "team", "Which team should handle this?",
                     (Option("billing"), Option("shipping"), Option("other"))),
    DecisionQuestion("score", "tone", "How upset is the customer?",
                     (Option("calm"), Option("annoyed"), Option("furious"))),
)  # fmt: skip
JSON_INSTRUCTION = (
    'Answer as JSON: {"refund": true or false, "team": "billing" | "shipping" | "other", '
    '"tone": "calm" | "annoyed" | "furious"}. Questions: does the customer ask for money back? '
    "which team should handle this? how upset is the customer?"
)


def state_of(model: LoadedModel, num_tokens: int, variant: int) -> str:
    """About `num_tokens` tokens of ticket text, starting with a word unique to `variant`."""
    text = f"Ticket {variant}. " + TICKET * (num_tokens // 40 + 2)
    ids = model.tokenizer.encode(text, add_special_tokens=False)[:num_tokens]
    return model.tokenizer.decode(ids)


async def json_answer_s(stage: InferenceStage, state: str, max_tokens: int) -> float:
    tokenizer = stage.model.tokenizer
    content = f"State:\n{state}\n\n{JSON_INSTRUCTION}"
    ids = tokenizer.encode_chat([{"role": "user", "content": content}])
    started = time.perf_counter()
    async for _ in stage.engine.submit(ids, SamplingParams(temperature=0.0, max_tokens=max_tokens)):
        pass
    return time.perf_counter() - started


async def decision_s(stage: InferenceStage, state: str) -> float:
    started = time.perf_counter()
    await decide(stage, DecisionRequest("bench", state, QUESTIONS))
    return time.perf_counter() - started


async def measure(model: LoadedModel, args: argparse.Namespace) -> dict[str, float]:
    stage = InferenceStage(Engine(model, EngineConfig(batch=8)), model)
    try:
        await decision_s(stage, state_of(model, 64, -1))  # warm-up
        cold, warm, generated = [], [], []
        for repeat in range(args.repeats):
            state = state_of(model, args.state_tokens, repeat)
            cold.append(await decision_s(stage, state))
            warm.append(await decision_s(stage, state))
            other = state_of(model, args.state_tokens, 1000 + repeat)
            generated.append(await json_answer_s(stage, other, args.json_tokens))
    finally:
        stage.close()
    return {
        "decisions_cold_ms": statistics.median(cold) * 1000,
        "decisions_warm_ms": statistics.median(warm) * 1000,
        "json_text_ms": statistics.median(generated) * 1000,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--state-tokens", type=int, default=300)
    parser.add_argument("--json-tokens", type=int, default=48)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    share_the_gil_with_the_engine()  # as `modelhost serve` does where engines run
    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    figures = asyncio.run(measure(model, args))
    print(f"{args.model}, {args.state_tokens}-token state, 3 questions, {args.threads} threads")
    print(f"{'case':<28}{'median ms':>12}")
    for name, value in figures.items():
        print(f"{name:<28}{value:>12.1f}")
    out = (
        args.out or Path("benchmarks/results") / f"decisions-{time.strftime('%Y%m%d-%H%M%S')}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    record: dict[str, object] = {**vars(args), **figures}
    record["out"] = str(out)
    out.write_text(json.dumps(record, indent=2, default=str))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
