"""Typed decisions on a generative engine, with no text generation.

The state is prefilled once by a row of its own, which commits its full KV blocks to the prefix
cache; then every question's row (state + question, one token to generate) is submitted as one
unit, so the engine admits them in the same step and each prefills only its tail. Each row
returns the raw log-probabilities of its answer keys; the answer is their distribution
renormalised over the options. Confidence is the winning option's probability; a score is the
expected level index. Usage counts the tokens the request carried (the state once), and how many
of the question rows' tokens came from the cache.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from modelhost.engine.events import EngineClosed, EngineEvent, PromptTooLong, QueueFull
from modelhost.engine.sampling.sampling_params import SamplingParams
from modelhost.inference.contracts import (
    ContextOverBudget,
    EngineUnavailable,
    QueueFullError,
)
from modelhost.inference.decision_prompt import (
    DecisionPrompts,
    DecisionQuestion,
    DecisionRequest,
    KeyedQuestion,
    build_prompts,
)

if TYPE_CHECKING:
    from modelhost.inference.stage import InferenceStage


@dataclass(frozen=True, slots=True)
class DecisionAnswer:
    question: DecisionQuestion
    probabilities: tuple[float, ...]  # per option, in the question's order; sums to 1
    label_mass: float  # the options' share of the whole next-token distribution

    @property
    def best(self) -> int:
        return max(range(len(self.probabilities)), key=self.probabilities.__getitem__)

    @property
    def confidence(self) -> float:
        return self.probabilities[self.best]

    @property
    def score(self) -> float:
        """The expected option index: a score question's fractional level."""
        return sum(i * p for i, p in enumerate(self.probabilities))


@dataclass(frozen=True, slots=True)
class DecisionUsage:
    input_tokens: int
    cached_tokens: int = 0
    output_tokens: int = 0  # decisions never generate

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens


@dataclass(frozen=True, slots=True)
class DecisionResult:
    request_id: str
    answers: tuple[DecisionAnswer, ...]
    usage: DecisionUsage


def answer_from_logprobs(keyed: KeyedQuestion, logprobs: list[float]) -> DecisionAnswer:
    """Renormalise the readout (the logprobs of `keyed.readout_token_ids`, in order) over the
    options; an option read through two tokens gets their summed probability."""
    masses: list[float] = []
    at = 0
    for ids in keyed.key_token_ids:
        masses.append(sum(math.exp(lp) for lp in logprobs[at : at + len(ids)]))
        at += len(ids)
    total = sum(masses)
    if total <= 0.0 or not math.isfinite(total):
        # The model put no representable mass on any key: say so evenly, never divide by zero.
        probabilities = tuple(1.0 / len(masses) for _ in masses)
    else:
        probabilities = tuple(mass / total for mass in masses)
    return DecisionAnswer(keyed.question, probabilities, min(total, 1.0))


async def decide(stage: InferenceStage, request: DecisionRequest) -> DecisionResult:
    """Answer every question of `request` on `stage`'s engine; raises the stage's RequestErrors."""
    if stage.closing:
        raise EngineUnavailable()
    prompts = await asyncio.to_thread(build_prompts, stage.model, request)
    longest = len(prompts.prefix_ids) + max(len(tail) for tail in prompts.tails)
    stage.policy.max_tokens_for(longest, 1, engine_context=stage.engine_context)
    engine = stage.engine
    block_size = engine.stats().kv_block_size
    if len(prompts.questions) > 1 and len(prompts.prefix_ids) >= block_size:
        # Prefill the state alone first: its committed blocks serve every question row below.
        await _run_rows(
            engine, [(prompts.prefix_ids, SamplingParams(temperature=0.0, max_tokens=1))]
        )
    rows = [
        (
            prompts.prefix_ids + tail,
            SamplingParams(temperature=0.0, max_tokens=1, readout_token_ids=q.readout_token_ids),
        )
        for q, tail in zip(prompts.questions, prompts.tails, strict=True)
    ]
    events = await _run_rows(engine, rows)
    answers = tuple(
        answer_from_logprobs(q, _readout(event))
        for q, event in zip(prompts.questions, events, strict=True)
    )
    return DecisionResult(request.request_id, answers, _usage(prompts, events))


def _usage(prompts: DecisionPrompts, events: list[EngineEvent]) -> DecisionUsage:
    input_tokens = len(prompts.prefix_ids) + sum(len(tail) for tail in prompts.tails)
    cached = sum(event.usage.cached_tokens for event in events if event.usage is not None)
    return DecisionUsage(input_tokens=input_tokens, cached_tokens=cached)


def _readout(event: EngineEvent) -> list[float]:
    if not event.logprobs:
        raise EngineUnavailable("the engine returned no readout for a decision")
    return [top.logprob for top in event.logprobs[0].top]


async def _run_rows(engine: Any, rows: list[tuple[list[int], SamplingParams]]) -> list[EngineEvent]:
    """Submit `rows` as one unit and wait for each one's first event (each generates one token);
    every row is cancelled however this ends."""
    try:
        streams = engine.submit_many(rows)
    except QueueFull as exc:
        raise QueueFullError() from exc
    except PromptTooLong as exc:
        message = (
            f"prompt is {exc.prompt_tokens} tokens but the engine caps context at {exc.limit} — "
            "no room to decide; shorten the state"
        )
        raise ContextOverBudget(message, exc.prompt_tokens, exc.limit) from exc
    except EngineClosed as exc:
        raise EngineUnavailable() from exc
    try:
        return list(await asyncio.gather(*(_first_event(stream) for stream in streams)))
    finally:
        for stream in streams:
            stream.cancel()


async def _first_event(stream: Any) -> EngineEvent:
    try:
        event: EngineEvent | None = await anext(stream, None)
    except EngineClosed as exc:
        raise EngineUnavailable() from exc
    if event is None or event.finish_reason == "abort":
        raise EngineUnavailable("the engine stopped the request (shutting down)")
    return event
