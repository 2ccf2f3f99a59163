"""Family records: which architectures are served, and which dialect a model's files declare."""

from __future__ import annotations

import pytest
from family_templates import template

from modelhost.models.families import (
    GEMMA_TOOL_CODE,
    GRANITE_THINKING,
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    PHI,
    PYTHONIC,
    THINK,
    THINKING,
    UnsupportedArchitecture,
    family_for,
    family_for_model,
    supported_architectures,
)

HF_TYPES = [
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "phi3",
    "gemma2",
    "gemma3",
    "gemma3_text",
    "smollm3",
    "granite",
]
GGUF_ARCHITECTURES = [
    "llama",
    "qwen2",
    "qwen3",
    "qwen3moe",
    "phi3",
    "gemma2",
    "gemma3",
    "smollm3",
    "granite",
]
# Vision-language spellings and the family each names (their text model's GGUF architecture
# is a text family's, or, for Qwen2-VL's M-RoPE, its own).
VISION_SPELLINGS = {
    "smolvlm": "smolvlm",
    "idefics3": "smolvlm",
    "qwen2_5_vl": "qwen2_5_vl",
    "qwen2vl": "qwen2_5_vl",
}


@pytest.mark.parametrize("spelling", sorted(VISION_SPELLINGS))
def test_every_vision_spelling_names_its_family(spelling: str) -> None:
    family = family_for(spelling)
    assert family.name == VISION_SPELLINGS[spelling]
    assert family.vision is True


@pytest.mark.parametrize("name", sorted({*HF_TYPES, *GGUF_ARCHITECTURES}))
def test_every_hf_and_gguf_spelling_of_a_supported_family_has_a_record(name: str) -> None:
    assert family_for(name).name == name.replace("_text", "").replace("_moe", "moe")


def test_the_supported_list_is_exactly_the_accepted_spellings_sorted() -> None:
    expected = sorted({*HF_TYPES, *GGUF_ARCHITECTURES, *VISION_SPELLINGS})
    assert supported_architectures() == expected


def test_an_unknown_architecture_is_refused_naming_it_and_the_supported_list() -> None:
    with pytest.raises(UnsupportedArchitecture) as refused:
        family_for("mamba")

    assert isinstance(refused.value, ValueError)
    message = str(refused.value)
    assert "'mamba'" in message
    assert all(name in message for name in supported_architectures())


def test_family_for_model_refuses_an_unknown_architecture_too() -> None:
    with pytest.raises(UnsupportedArchitecture):
        family_for_model("deepseek2", template("qwen3"))


@pytest.mark.parametrize(
    ("architecture", "fixture", "dialect"),
    [
        ("llama", "llama3", LLAMA3_JSON),
        ("llama", "mistral", MISTRAL),  # GGUF writes Mistral as `llama`
        ("llama", "qwen2_5", HERMES),  # a Hermes-style fine-tune of Llama
        ("mistral", "mistral", MISTRAL),
        ("qwen2", "qwen2_5", HERMES),
        ("qwen3", "qwen3", HERMES),
        ("phi3", "phi4_mini", PHI),
        ("gemma2", "gemma2", GEMMA_TOOL_CODE),
        ("gemma3", "gemma3", GEMMA_TOOL_CODE),
        ("smollm3", "smollm3", HERMES),
        ("granite", "granite", PHI),
        ("granite", "granite3_3", PHI),
        ("llama", "llama3_2_pythonic", PYTHONIC),  # Llama 3.2's call as a Python list
    ],
)
def test_the_tool_call_dialect_follows_the_models_own_template(
    architecture: str, fixture: str, dialect: object
) -> None:
    assert family_for_model(architecture, template(fixture)).tool_dialect == dialect


def test_the_vocabulary_names_the_dialect_when_the_template_does_not() -> None:
    def llama3_vocabulary(token: str) -> bool:
        return token in ("<|python_tag|>", "<|eom_id|>", "<|eot_id|>")

    def mistral_vocabulary(token: str) -> bool:
        return token in ("[TOOL_CALLS]", "[INST]")

    chatml = family_for("qwen2").chat_template
    assert family_for_model("qwen2", chatml, llama3_vocabulary).tool_dialect == LLAMA3_JSON
    assert family_for_model("llama", None, mistral_vocabulary).tool_dialect == MISTRAL


def test_a_think_tag_in_the_template_turns_reasoning_on() -> None:
    assert family_for("llama").reasoning_markers is None
    assert family_for_model("llama", template("qwen3")).reasoning_markers == THINK
    assert family_for_model("smollm3", template("smollm3")).reasoning_markers == THINK
    assert family_for_model("qwen2", template("qwen2_5")).reasoning_markers is None


def test_granite_3_3s_template_declares_response_tags_and_its_own_thinking_switch() -> None:
    granite = family_for_model("granite", template("granite3_3"))

    assert granite.reasoning == GRANITE_THINKING
    assert granite.reasoning_markers == THINK
    assert GRANITE_THINKING.answer == ("<response>", "</response>")
    assert granite.thinking_switch == "thinking"
    assert family_for_model("qwen3", template("qwen3")).reasoning == THINKING
    assert family_for_model("granite", template("granite")).reasoning is None  # Granite 3.1


def test_a_mistral_dialect_asks_for_nine_character_call_ids_whatever_the_architecture() -> None:
    assert family_for_model("llama", template("mistral")).tool_call_id_length == 9
    assert family_for_model("llama", template("llama3")).tool_call_id_length is None


@pytest.mark.parametrize(
    ("name", "tokens"),
    [
        ("llama", {"<|eot_id|>", "<|eom_id|>"}),
        ("mistral", {"</s>"}),
        ("qwen2", {"<|im_end|>"}),
        ("qwen3moe", {"<|im_end|>"}),
        ("phi3", {"<|end|>"}),
        ("gemma2", {"<end_of_turn>"}),
        ("gemma3", {"<end_of_turn>"}),
        ("smollm3", {"<|im_end|>"}),
        ("granite", {"<|end_of_text|>"}),
    ],
)
def test_each_family_ends_generation_at_its_end_of_turn_tokens(name: str, tokens: set[str]) -> None:
    assert tokens <= set(family_for(name).eos_tokens)


def test_markup_tokens_are_the_dialects_special_pieces_and_the_reasoning_tags() -> None:
    assert family_for("mistral").markup_tokens == ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")
    assert set(family_for("qwen3").markup_tokens) == {"<tool_call>", "</tool_call>", *THINK}
