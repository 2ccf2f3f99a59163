"""Sampling defaults: what a request did not set comes from the CLI, then from the model.

Precedence per knob (first set wins):

| knob               | request | CLI flag        | model (generation_config) | fallback      |
| ------------------ | ------- | --------------- | ------------------------- | ------------- |
| max_tokens         | yes     | --max-tokens    |                           | the room left |
| temperature        | yes     | --temperature   | gen temperature           | 0.7           |
| top_p              | yes     | --top-p         | gen top_p                 | off           |
| top_k              | yes     | --top-k         | gen top_k                 | off           |
| repetition_penalty | yes     |                 | gen repetition_penalty    | off           |

Whatever max_tokens resolves to is then clamped to the room the context leaves after the prompt
(admission's `max_tokens_for`; "the room left" is all of it). The model-default temperature is
capped at 0.7 when thinking resolves to off. `top_p` 0 and `top_k` 0 mean off. The seed is the
request's, else a fresh one per request (the engine's).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from modelhost.engine.sampling.sampling_params import InvalidSamplingParams, SamplingParams
from modelhost.inference.contracts import InferenceRequest, InvalidRequest

FALLBACK_TEMPERATURE = 0.7
NO_THINK_TEMPERATURE = 0.7


@dataclass(frozen=True, slots=True)
class ServingDefaults:
    """The serve command's own defaults (`None`: not given on the command line)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None


def _first(*values: float | None) -> float | None:
    return next((value for value in values if value is not None), None)


def requested_max_tokens(request: InferenceRequest, defaults: ServingDefaults) -> int | None:
    """The completion budget asked for, before admission clamps it: the request's, else the
    CLI's; None for all the room the context leaves."""
    if request.max_tokens is not None:
        return request.max_tokens
    return defaults.max_tokens


def resolve_sampling(
    request: InferenceRequest,
    defaults: ServingDefaults,
    gen_defaults: Mapping[str, float],
    *,
    max_tokens: int,
) -> SamplingParams:
    """The engine's SamplingParams for an admitted request (max_tokens already clamped)."""
    asked = request.sampling
    model_temperature = gen_defaults.get("temperature", FALLBACK_TEMPERATURE)
    if request.thinking is False:
        model_temperature = min(model_temperature, NO_THINK_TEMPERATURE)
    temperature = _first(asked.temperature, defaults.temperature, model_temperature)
    top_p = _first(asked.top_p, defaults.top_p, gen_defaults.get("top_p"))
    top_k = _first(asked.top_k, defaults.top_k, gen_defaults.get("top_k"))
    repetition_penalty = _first(asked.repetition_penalty, gen_defaults.get("repetition_penalty"))
    try:
        return SamplingParams(
            temperature=float(temperature if temperature is not None else FALLBACK_TEMPERATURE),
            top_p=float(top_p) if top_p else 1.0,
            top_k=int(top_k) if top_k else 0,
            min_p=float(asked.min_p or 0.0),
            repetition_penalty=float(repetition_penalty or 1.0),
            presence_penalty=float(asked.presence_penalty or 0.0),
            frequency_penalty=float(asked.frequency_penalty or 0.0),
            logit_bias=dict(asked.logit_bias),
            seed=asked.seed,
            max_tokens=max_tokens,
            stop=request.stop,
            ignore_eos=request.ignore_eos,
            logprobs=request.logprobs,
            prompt_logprobs=request.prompt_logprobs,
            speculate=asked.speculate is not False,
        )
    except InvalidSamplingParams as exc:
        raise InvalidRequest(str(exc)) from exc
