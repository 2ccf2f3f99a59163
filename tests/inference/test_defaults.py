"""Sampling defaults: request, then the serve flags, then the model, then the fallbacks."""

from __future__ import annotations

import dataclasses

import pytest

from modelhost.inference.contracts import (
    InferenceRequest,
    InvalidRequest,
    SamplingRequest,
    TextPrompt,
)
from modelhost.inference.defaults import ServingDefaults, requested_max_tokens, resolve_sampling


def request(thinking: bool | None = None, **sampling: object) -> InferenceRequest:
    return InferenceRequest(
        request_id="r",
        method="text",
        prompt=TextPrompt("hi"),
        sampling=SamplingRequest(**sampling),  # type: ignore[arg-type]
        thinking=thinking,
    )


MODEL = {"temperature": 0.9, "top_p": 0.8, "top_k": 40, "repetition_penalty": 1.1}
FLAGS = ServingDefaults(temperature=0.3, top_p=0.5, top_k=5)


def test_request_values_win_over_flags_and_model_defaults() -> None:
    asked = request(temperature=0.1, top_p=0.2, top_k=3, repetition_penalty=1.3)
    params = resolve_sampling(asked, FLAGS, MODEL, max_tokens=8)
    assert (params.temperature, params.top_p, params.top_k) == (0.1, 0.2, 3)
    assert params.repetition_penalty == 1.3


def test_serve_flags_win_over_model_defaults() -> None:
    params = resolve_sampling(request(), FLAGS, MODEL, max_tokens=8)
    assert (params.temperature, params.top_p, params.top_k) == (0.3, 0.5, 5)


def test_model_defaults_apply_when_neither_request_nor_flags_set_a_knob() -> None:
    params = resolve_sampling(request(), ServingDefaults(), MODEL, max_tokens=8)
    assert (params.temperature, params.top_p, params.top_k) == (0.9, 0.8, 40)
    assert params.repetition_penalty == 1.1


def test_fallbacks_are_temperature_0_7_and_every_filter_off() -> None:
    params = resolve_sampling(request(), ServingDefaults(), {}, max_tokens=8)
    assert params.temperature == 0.7
    assert (params.top_p, params.top_k, params.min_p, params.repetition_penalty) == (1, 0, 0, 1)


def test_model_temperature_is_capped_at_0_7_when_thinking_is_off() -> None:
    params = resolve_sampling(request(thinking=False), ServingDefaults(), MODEL, max_tokens=8)
    assert params.temperature == 0.7


def test_top_p_zero_means_off() -> None:
    params = resolve_sampling(request(top_p=0.0), ServingDefaults(), {}, max_tokens=8)
    assert params.top_p == 1.0


def test_resolved_params_carry_the_clamped_max_tokens_and_the_seed() -> None:
    params = resolve_sampling(request(seed=7), ServingDefaults(), {}, max_tokens=12)
    assert (params.max_tokens, params.seed) == (12, 7)


def test_an_out_of_range_knob_is_a_400() -> None:
    with pytest.raises(InvalidRequest):
        resolve_sampling(request(repetition_penalty=-1.0), ServingDefaults(), {}, max_tokens=8)


def test_max_tokens_is_the_request_s_then_the_flag_s_then_all_the_room_left() -> None:
    asked = dataclasses.replace(request(), max_tokens=12)
    assert requested_max_tokens(asked, ServingDefaults(max_tokens=40)) == 12
    assert requested_max_tokens(request(), ServingDefaults(max_tokens=40)) == 40
    assert requested_max_tokens(request(), ServingDefaults()) is None
