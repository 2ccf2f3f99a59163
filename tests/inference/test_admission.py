"""Admission: the safe context from a memory budget, the clamp, the refusal, and placement."""

from __future__ import annotations

import pytest
from scripted_engine import scripted_model

from modelhost.inference.admission import (
    AdmissionPolicy,
    BudgetTooSmall,
    check_placement,
    plan_memory,
    working_bytes,
)
from modelhost.inference.contracts import (
    ContextOverBudget,
    InferenceRequest,
    TextPrompt,
    UnsupportedExecution,
)

CONFIG = scripted_model().config
KV_PER_TOKEN = CONFIG.kv_bytes_per_token(4)
WEIGHTS = 1_000_000


def total_bytes(context: int) -> int:
    work = working_bytes(CONFIG, 4, context, chunk_tokens=512, rows=8)
    return WEIGHTS + context * KV_PER_TOKEN + work


def request(**fields: object) -> InferenceRequest:
    return InferenceRequest(request_id="r", method="text", prompt=TextPrompt("hi"), **fields)


def test_plan_memory_finds_the_largest_context_whose_weights_kv_and_working_memory_fit() -> None:
    budget = 3_000_000
    plan = plan_memory(CONFIG, weights_bytes=WEIGHTS, dtype_bytes=4, memory_budget_bytes=budget)
    assert total_bytes(plan.max_safe_context) <= budget
    assert total_bytes(plan.max_safe_context + 1) > budget
    assert plan.kv_bytes >= plan.max_safe_context * KV_PER_TOKEN


def test_plan_memory_counts_fp16_keys_and_values_at_their_own_size() -> None:
    budget = 3_000_000
    plan = plan_memory(
        CONFIG, weights_bytes=WEIGHTS, dtype_bytes=4, kv_dtype_bytes=2, memory_budget_bytes=budget
    )
    fp32 = plan_memory(CONFIG, weights_bytes=WEIGHTS, dtype_bytes=4, memory_budget_bytes=budget)
    work = working_bytes(CONFIG, 4, plan.max_safe_context, chunk_tokens=512, rows=8)
    assert plan.kv_bytes_per_token == KV_PER_TOKEN // 2
    assert WEIGHTS + plan.max_safe_context * KV_PER_TOKEN // 2 + work <= budget
    assert plan.max_safe_context > fp32.max_safe_context


def test_plan_memory_refuses_a_budget_that_cannot_hold_the_weights() -> None:
    with pytest.raises(BudgetTooSmall, match="cannot hold the weights"):
        plan_memory(CONFIG, weights_bytes=WEIGHTS, dtype_bytes=4, memory_budget_bytes=WEIGHTS)


def test_policy_clamps_the_requested_completion_to_the_room_left() -> None:
    policy = AdmissionPolicy(context_window=100)
    assert policy.max_tokens_for(90, 50) == 10


def test_policy_keeps_a_requested_completion_that_fits() -> None:
    assert AdmissionPolicy(context_window=100).max_tokens_for(10, 50) == 50


def test_policy_grants_all_the_room_left_when_no_completion_length_is_requested() -> None:
    assert AdmissionPolicy(context_window=100).max_tokens_for(30, None) == 70


def test_policy_refuses_a_prompt_that_leaves_no_room_in_the_safe_context() -> None:
    budget = 3_000_000
    plan = plan_memory(CONFIG, weights_bytes=WEIGHTS, dtype_bytes=4, memory_budget_bytes=budget)
    policy = AdmissionPolicy(context_window=1 << 20, memory=plan)
    limit = plan.max_safe_context
    with pytest.raises(ContextOverBudget) as refused:
        policy.max_tokens_for(limit, 10)
    assert refused.value.status == 400
    assert refused.value.body["type"] == "memory_admission"
    assert refused.value.body["code"] == "context_over_budget"
    assert refused.value.message == (
        f"prompt is {limit} tokens but the memory budget caps safe context at {limit} — "
        "no room to generate; shorten the prompt or raise --memory-budget"
    )


def test_policy_refuses_a_prompt_longer_than_the_context_window_without_a_budget() -> None:
    with pytest.raises(ContextOverBudget) as refused:
        AdmissionPolicy(context_window=64).max_tokens_for(80, None)
    assert refused.value.body["code"] == "context_over_budget"
    assert "prompt is 80 tokens but the context window is 64" in refused.value.message


def test_policy_holds_the_model_window_as_a_ceiling_even_under_a_generous_budget() -> None:
    plan = plan_memory(CONFIG, weights_bytes=WEIGHTS, dtype_bytes=4, memory_budget_bytes=10**12)
    policy = AdmissionPolicy(context_window=128, memory=plan)
    assert policy.enforced_context == 128
    assert policy.max_tokens_for(100, None) == 28


def test_policy_holds_the_engine_context_as_a_ceiling_too() -> None:
    policy = AdmissionPolicy(context_window=1000)
    assert policy.max_tokens_for(10, None, engine_context=50) == 40


def test_placement_accepts_a_plain_single_choice_request() -> None:
    check_placement(request(), "llama")


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"num_choices": 2}, "multi-choice-batch-unsupported"),
        ({"has_media": True}, "media-batch-unsupported"),
    ],
)
def test_placement_refuses_a_shape_the_batch_cannot_run_with_its_reason(
    fields: dict[str, object], reason: str
) -> None:
    with pytest.raises(UnsupportedExecution) as refused:
        check_placement(request(**fields), "llama")
    assert refused.value.status == 501
    assert refused.value.reasons == (reason,)
    assert refused.value.message == (
        f"model llama method text does not support shared execution: {reason}"
    )


def test_placement_places_an_adapters_rows_in_the_shared_batch() -> None:
    check_placement(request(adapter="my-lora"), "llama")
