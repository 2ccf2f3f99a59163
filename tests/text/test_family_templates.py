"""Each family's chat template renders a tool conversation in the sandbox, in its own form.

The templates are small fixtures written after the official ones (tests/fixtures/templates/);
the conversation is what the server hands the template: a user question, an assistant turn that
called a tool (arguments already parsed to an object, ids as OpenAI clients send them), and the
tool's result.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Mapping
from typing import Any

import pytest
import tokenizers
from family_templates import template

from modelhost.inference.prompt import template_inputs
from modelhost.models.families import family_for_model
from modelhost.text.tokenizer import ChatTemplateError, Tokenizer

TOOLS = (
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
)
CALL = {
    "id": "call_5f2a9c1e",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
}
CONVERSATION: tuple[Mapping[str, Any], ...] = (
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_5f2a9c1e", "content": "sunny"},
)


def tokenizer_for(text: str) -> Tokenizer:
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    backend.add_special_tokens(["<s>", "</s>"])
    return Tokenizer(
        backend,
        chat_template=text,
        eos_token_ids=[2],
        add_bos_token=False,
        bos_token="<s>",
        eos_token="</s>",
    )


def render(
    architecture: str,
    fixture: str,
    messages: tuple[Mapping[str, Any], ...] = CONVERSATION,
    **kwargs: Any,
) -> str:
    text = template(fixture)
    tokenizer = tokenizer_for(text)
    family = family_for_model(architecture, text)
    shaped, tools = template_inputs(family, tokenizer, messages, TOOLS)
    return tokenizer.render_chat(shaped, add_generation_prompt=True, tools=tools, **kwargs)


def test_llama3_declares_the_tools_writes_the_call_as_json_and_the_result_as_ipython() -> None:
    rendered = render("llama", "llama3")

    today = datetime.date.today().strftime("%d %b %Y")
    assert f"Today Date: {today}\n" in rendered  # strftime_now
    assert '    "name": "get_weather",' in rendered  # tojson(indent=4)
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>' in rendered
    assert "<|start_header_id|>ipython<|end_header_id|>\n\nsunny<|eot_id|>" in rendered
    assert rendered.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_qwen2_5_writes_the_call_in_tool_call_tags_and_the_result_as_a_tool_response() -> None:
    rendered = render("qwen2", "qwen2_5")

    assert "<tools>\n" + '{"type": "function", "function": {"name": "get_weather"' in rendered
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert call in rendered
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in rendered
    assert rendered.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_qwen3_with_thinking_off_closes_an_empty_think_block_in_the_generation_prompt() -> None:
    thinking = render("qwen3", "qwen3")
    quiet = render("qwen3", "qwen3", enable_thinking=False)

    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in thinking
    assert thinking.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert quiet.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_qwen3_moe_uses_the_same_template_and_markup_as_qwen3() -> None:
    assert render("qwen3_moe", "qwen3") == render("qwen3", "qwen3")


def test_mistral_gets_nine_character_call_ids_that_still_pair_the_call_with_its_result() -> None:
    rendered = render("mistral", "mistral")

    calls = re.findall(r'\[TOOL_CALLS\] \[\{.*"id": "([A-Za-z0-9]{9})"\}\]</s>', rendered)
    results = re.findall(r'\[TOOL_RESULTS\] \{"content": sunny, "call_id": "(\w+)"\}', rendered)
    assert calls and calls == results
    assert '"name": "get_weather", "arguments": {"city": "Paris"}' in rendered
    assert "[AVAILABLE_TOOLS] [" in rendered
    assert rendered.endswith("[/TOOL_RESULTS]")  # the assistant's turn starts right after


def test_mistrals_template_refuses_other_call_ids_when_they_are_not_rewritten() -> None:
    tokenizer = tokenizer_for(template("mistral"))

    with pytest.raises(ChatTemplateError, match="length 9"):
        tokenizer.render_chat(CONVERSATION, tools=TOOLS)


def test_phi4_mini_reads_the_tools_from_the_system_message_and_the_call_from_the_content() -> None:
    rendered = render("phi3", "phi4_mini")

    assert rendered.startswith('<|system|>Be brief.<|tool|>[{"name": "get_weather"')
    assert "<|/tool|><|end|><|user|>Weather in Paris?<|end|>" in rendered
    call = '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]<|/tool_call|>'
    assert f"<|assistant|>{call}<|end|>" in rendered
    assert rendered.endswith("<|tool|>sunny<|end|><|assistant|>")


@pytest.mark.parametrize("fixture", ["gemma2", "gemma3"])
def test_gemma_gets_the_call_and_result_as_fences_and_the_system_text_in_the_first_turn(
    fixture: str,
) -> None:
    rendered = render(fixture, fixture)

    assert rendered.startswith("<s><start_of_turn>user\nBe brief.\n\n")
    assert '"name": "get_weather"' in rendered
    assert "<start_of_turn>model\n```tool_code\nget_weather(city='Paris')\n```<end_of_turn>" in (
        rendered
    )
    assert rendered.endswith("```tool_output\nsunny\n```<end_of_turn>\n<start_of_turn>model\n")


def test_gemma2s_template_refuses_a_system_turn_that_is_not_folded() -> None:
    with pytest.raises(ChatTemplateError, match="System role not supported"):
        tokenizer_for(template("gemma2")).render_chat(CONVERSATION[:2])


@pytest.mark.parametrize(
    ("system", "kwargs", "mode"),
    [
        ("Be brief.", {}, "/think"),
        ("Be brief. /no_think", {}, "/no_think"),
        ("Be brief.", {"enable_thinking": False}, "/no_think"),
        ("Be brief. /think", {"enable_thinking": False}, "/think"),
    ],
)
def test_smollm3_takes_think_flags_from_the_system_text_and_the_thinking_switch(
    system: str, kwargs: dict[str, Any], mode: str
) -> None:
    messages = ({"role": "system", "content": system}, *CONVERSATION[1:])

    rendered = render("smollm3", "smollm3", messages, **kwargs)

    assert f"Reasoning Mode: {mode}\n" in rendered
    assert "## Custom Instructions\n\nBe brief.\n\n###" in rendered  # the flag is not shown
    assert "'name': 'get_weather'" in rendered  # tools printed as Python dicts
    assert "<|im_start|>user\nsunny<|im_end|>\n" in rendered
    prompt = "<|im_start|>assistant\n" + ("" if mode == "/think" else "<think>\n\n</think>\n")
    assert rendered.endswith("<|im_end|>\n" + prompt)


def test_granite_writes_the_call_after_its_tool_call_token_and_the_result_as_tool_response() -> (
    None
):
    rendered = render("granite", "granite", CONVERSATION[1:])

    assert "Today's Date: " + datetime.date.today().strftime("%B %d, %Y") in rendered
    assert "<|start_of_role|>tools<|end_of_role|>[\n    {" in rendered
    call = '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]<|end_of_text|>'
    assert call in rendered
    assert "<|start_of_role|>tool_response<|end_of_role|>sunny<|end_of_text|>" in rendered
    assert rendered.endswith("<|end_of_text|>\n<|start_of_role|>assistant<|end_of_role|>")


def test_llama3_2_pythonic_asks_for_a_python_list_and_writes_past_calls_in_that_form() -> None:
    rendered = render("llama", "llama3_2_pythonic")

    assert "you MUST put it in the format of [func_name1(" in rendered
    assert '[get_weather(city="Paris")]<|eot_id|>' in rendered
    assert rendered.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


@pytest.mark.parametrize("thinking", [True, False])
def test_granite_3_3_asks_for_think_and_response_tags_when_its_thinking_switch_is_on(
    thinking: bool,
) -> None:
    text = template("granite3_3")
    family = family_for_model("granite", text)
    question = [{"role": "user", "content": "What is 1+1?"}]

    rendered = tokenizer_for(text).render_chat(
        question, add_generation_prompt=True, **{family.thinking_switch: thinking}
    )

    asked = "write your response between <response></response>" in rendered
    assert asked is thinking


@pytest.mark.parametrize(
    "body",
    [
        "{{ ''.__class__.__mro__ }}",
        "{% set seen = [] %}{{ seen.append(1) }}",
        "{{ messages.clear() }}",
    ],
)
def test_a_template_that_reaches_outside_the_sandbox_is_refused(body: str) -> None:
    with pytest.raises(ChatTemplateError):
        tokenizer_for(body).render_chat(CONVERSATION[1:2])


def test_a_template_that_does_not_parse_is_a_chat_template_error() -> None:
    with pytest.raises(ChatTemplateError, match="does not parse"):
        tokenizer_for("{% for message in messages %}")


IMAGE_CONVERSATIONS: tuple[tuple[Mapping[str, Any], ...], ...] = (
    ({"role": "user", "content": [{"type": "text", "text": "What is it? "}, {"type": "image"}]},),
    (
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " Describe."}]},
        {"role": "assistant", "content": "A cat."},
        {"role": "user", "content": [{"type": "image"}, {"type": "image"}]},
    ),
    (
        {"role": "system", "content": [{"type": "text", "text": "Answer in French."}]},
        {"role": "user", "content": "Bonjour"},
    ),
)


@pytest.mark.parametrize("messages", IMAGE_CONVERSATIONS)
def test_gemma_family_template_places_images_as_gemma3s_own_template_does(
    messages: tuple[Mapping[str, Any], ...],
) -> None:
    """A Gemma 3 GGUF without a template falls back to the family's: it writes an image part
    as <start_of_image>, where the vision tower puts the image's soft tokens."""
    fallback = family_for_model("gemma3", None).chat_template
    assert fallback is not None
    ours = tokenizer_for(fallback).render_chat(messages)
    assert ours == tokenizer_for(template("gemma3_vision")).render_chat(messages)
    parts = [p for m in messages if not isinstance(m["content"], str) for p in m["content"]]
    assert ours.count("<start_of_image>") == sum(p["type"] == "image" for p in parts)
