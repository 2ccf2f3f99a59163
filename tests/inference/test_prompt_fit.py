"""Trimming a prompt to the window: the newest turns and the system messages stay, a cut never
leaves a tool result without its call, and raw ids keep their end."""

from __future__ import annotations

from typing import Any

from scripted_engine import scripted_model

from modelhost.inference.contracts import ChatPrompt, InferenceRequest, TokenPrompt
from modelhost.inference.prompt_fit import answer_room, fit_prompt

MODEL = scripted_model()
CALL = {"id": "call_1", "type": "function", "function": {"name": "look", "arguments": "{}"}}


def chat(messages: list[dict[str, Any]]) -> InferenceRequest:
    return InferenceRequest("r", "chat", ChatPrompt(tuple(messages)))


def text_of(ids: list[int]) -> str:
    return MODEL.tokenizer.decode(ids, skip_special_tokens=False)


def test_a_cut_starts_at_a_user_turn_so_no_tool_result_loses_its_call() -> None:
    messages = [
        {"role": "system", "content": "SYS"},
        {"role": "user", "content": "old " * 30},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "RESULT " * 5},
        {"role": "user", "content": "NEWEST"},
    ]
    ids = fit_prompt(MODEL, chat(messages), None, budget=60)
    assert ids is not None and len(ids) <= 60
    kept = text_of(ids)
    assert "SYS" in kept and "NEWEST" in kept and "RESULT" not in kept


def test_token_ids_keep_their_end() -> None:
    request = InferenceRequest("r", "text", TokenPrompt(tuple(range(10, 40))))
    assert fit_prompt(MODEL, request, None, budget=5) == [35, 36, 37, 38, 39]


def test_the_answer_keeps_max_tokens_of_room_up_to_half_the_window() -> None:
    assert answer_room(1000, 100) == 100
    assert answer_room(1000, 5000) == 500
    assert answer_room(1000, None) == 250
