"""The admission check of a constrained request's budget: a budget smaller than the shortest
valid answer is a 400 naming the field and the minimum; one that fits passes."""

from __future__ import annotations

from modelhost.inference.contracts import GrammarSpec
from modelhost.inference.grammars.compiler import budget_refusal

SCHEMA = GrammarSpec("json_schema", "{}", field="response_format.json_schema")


def test_a_budget_that_fits_the_shortest_answer_passes() -> None:
    assert budget_refusal(SCHEMA, 10, 10, requested=True, field="max_tokens") is None


def test_a_requested_budget_below_the_shortest_answer_names_the_field_and_the_minimum() -> None:
    refusal = budget_refusal(SCHEMA, 10, 4, requested=True, field="max_output_tokens")
    assert refusal is not None and refusal.status == 400
    assert refusal.body["param"] == "max_output_tokens"
    assert refusal.body["code"] == "max_tokens_too_small"
    assert refusal.message == (
        "max_output_tokens is 4 but the shortest answer that satisfies "
        "response_format.json_schema takes 10 tokens; set max_output_tokens to at least 10"
    )


def test_a_forced_tool_call_says_what_forces_it() -> None:
    forced = GrammarSpec("json_schema", "{}", field="tools")
    refusal = budget_refusal(forced, 14, 8, requested=True, field="max_tokens")
    assert refusal is not None
    assert "the shortest tool call that tool_choice forces takes 14 tokens" in refusal.message


def test_a_context_too_full_for_the_shortest_answer_says_what_is_left() -> None:
    refusal = budget_refusal(SCHEMA, 10, 3, requested=False, field="max_tokens")
    assert refusal is not None
    assert refusal.message.startswith("only 3 tokens are left for the answer but the shortest")
