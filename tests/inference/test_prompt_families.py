"""A chat request's prompt, built through the family's own template (the fixtures in
tests/fixtures/templates/): the thinking switch and the tool declarations reach it."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from family_templates import template
from scripted_engine import char_tokenizer, scripted_model

from modelhost.inference.channels import OutputChannels
from modelhost.inference.contracts import ChatPrompt, CompletionEvent, InferenceRequest
from modelhost.inference.prompt import prompt_ids_for
from modelhost.models.families import family_for_model
from modelhost.models.loaded import LoadedModel
from modelhost.text.tokenizer import Tokenizer

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
QUESTION = ({"role": "user", "content": "Weather in Paris?"},)


def model_with(architecture: str, fixture: str) -> LoadedModel:
    text = template(fixture)
    tokenizer = Tokenizer(
        char_tokenizer(),
        chat_template=text,
        eos_token_ids=[2],
        add_bos_token=False,
        bos_token=None,
        eos_token="<|im_end|>",
    )
    family = family_for_model(architecture, text)
    return dataclasses.replace(scripted_model(), tokenizer=tokenizer, family=family)


def rendered(model: LoadedModel, request: InferenceRequest) -> str:
    return model.tokenizer.decode(prompt_ids_for(model, request), skip_special_tokens=False)


def chat(messages: tuple[dict[str, Any], ...], **fields: Any) -> InferenceRequest:
    return InferenceRequest("r", "chat", ChatPrompt(messages=messages, tools=(TOOL,)), **fields)


@pytest.mark.parametrize(
    ("thinking", "ending"),
    [(None, "<|im_start|>assistant\n"), (False, "<|im_start|>assistant\n<think>\n\n</think>\n")],
)
def test_a_requests_thinking_switch_reaches_smollm3s_template(
    thinking: bool | None, ending: str
) -> None:
    model = model_with("smollm3", "smollm3")

    prompt = rendered(model, chat(QUESTION, thinking=thinking))

    assert prompt.endswith(ending)
    assert "<tools>\n{'type': 'function'" in prompt


def test_smollm3_with_no_think_in_the_system_text_answers_straight_into_content() -> None:
    model = model_with("smollm3", "smollm3")
    request = chat(({"role": "system", "content": "/no_think"}, *QUESTION))
    tail = rendered(model, request)[-40:]

    channels = OutputChannels.for_request(request, model.family, lambda: tail)

    assert channels is not None
    assert tail.endswith("<think>\n\n</think>\n")
    assert channels.apply(CompletionEvent(text="Sunny.")).text == "Sunny."


def test_phi4_minis_prompt_declares_the_tools_in_the_system_turn() -> None:
    model = model_with("phi3", "phi4_mini")

    prompt = rendered(model, chat(QUESTION))

    assert prompt.startswith('<|system|><|tool|>[{"name": "get_weather"')
    assert prompt.endswith("<|user|>Weather in Paris?<|end|><|assistant|>")
