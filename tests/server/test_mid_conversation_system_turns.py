"""A system message sent mid-conversation stays where it was sent, on every surface: as a system
turn where the template takes one there, else inside the user turn next to it; never hoisted to
the front (which would change the prompt's start, and lose the cached prefix, every turn)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anthropic
import openai
from scripted_engine import ScriptedEngine, scripted_model
from starlette.applications import Starlette

from modelhost.text.turns import system_in_first_user_turn

AppFactory = Callable[..., Starlette]
# Mistral-like: a system turn anywhere but first is an error, as in Gemma's and Mistral's own.
FIRST_ONLY_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('System role only first') }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "system", "content": "Plan mode is on."},
    {"role": "user", "content": "Go on."},
]


def prompt_of(engine: ScriptedEngine) -> str:
    return scripted_model().tokenizer.decode(engine.submissions[-1].prompt_ids, False)


def test_openai_chat_keeps_a_later_system_message_in_place(
    make_app: AppFactory, live_server: Any
) -> None:
    engine = ScriptedEngine()
    base_url = live_server(make_app(engine)).base_url
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0) as client:
        turns: Any = CONVERSATION
        client.chat.completions.create(model="m", messages=turns)
    assert prompt_of(engine) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>system\nPlan mode is on.<|im_end|>\n"
        "<|im_start|>user\nGo on.<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_template_that_takes_a_system_turn_only_first_gets_it_in_the_next_user_turn(
    make_app: AppFactory, live_server: Any
) -> None:
    engine = ScriptedEngine()
    model = scripted_model(template=FIRST_ONLY_TEMPLATE)
    base_url = live_server(make_app(engine, model)).base_url
    with anthropic.Anthropic(base_url=base_url, api_key="none", max_retries=0) as client:
        turns: Any = CONVERSATION[1:]
        message = client.messages.create(
            model="m", max_tokens=64, system="Be brief.", messages=turns
        )
    assert message.stop_reason == "end_turn"
    assert prompt_of(engine) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\nPlan mode is on.\n\nGo on.<|im_end|>\n<|im_start|>assistant\n"
    )


def test_without_system_turns_a_later_system_message_joins_the_next_user_turn() -> None:
    assert system_in_first_user_turn(CONVERSATION) == [
        {"role": "user", "content": "Be brief.\n\nHi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Plan mode is on.\n\nGo on."},
    ]


def test_a_last_system_message_with_no_user_turn_after_it_joins_the_previous_user_turn() -> None:
    messages = [*CONVERSATION[1:2], {"role": "system", "content": "Be careful."}]
    assert system_in_first_user_turn(messages) == [{"role": "user", "content": "Hi\n\nBe careful."}]
