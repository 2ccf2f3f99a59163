"""One capability record per model family; no other layer branches on a family name.

A record says what the text layers need: the fallback chat template (used only when the model's
files carry none), the end-of-turn tokens that end generation, the tool-call markup the parser
reads, the reasoning tags, and which of those are special tokens that detokenizing must keep.

An architecture name does not pin a dialect: GGUF writes Llama 3, SmolLM2, Mistral and many
fine-tunes all as `llama`, and a Hermes fine-tune of Llama 3 writes Qwen's `<tool_call>`. So
`family_for_model` starts from the architecture's record and lets the model's own chat template
(then its vocabulary) override the tool-call and reasoning dialect when they name one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Gemma's turn format; system text is folded into the first user turn, as Google's template does,
# and an image part is <start_of_image> (Gemma 3's template writes it; the vision tower expands
# it into the soft tokens), so a Gemma 3 GGUF without a template still reads images.
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set head = messages[0]['content'] %}"
    "{% if head is not string %}{% set head = head[0]['text'] %}{% endif %}"
    "{% set system = head + '\\n\\n' %}{% set rest = messages[1:] %}"
    "{% else %}{% set system = '' %}{% set rest = messages %}{% endif %}"
    "{% for message in rest %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' }}"
    "{% if loop.first %}{{ system }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% elif message['content'] %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)

# Mistral's [INST] turns; like Mistral's own v1 template, system text joins the first user turn.
MISTRAL_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] + '\\n\\n' %}{% set rest = messages[1:] %}"
    "{% else %}{% set system = '' %}{% set rest = messages %}{% endif %}"
    "{% for message in rest %}"
    "{% if message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ '[INST] ' + (system if loop.first else '') + message['content'] + '[/INST]' }}"
    "{% endif %}{% endfor %}"
)

PHI3_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

GRANITE_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|start_of_role|>' + message['role'] + '<|end_of_role|>' + message['content']"
    " + '<|end_of_text|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_of_role|>assistant<|end_of_role|>' }}{% endif %}"
)

# SmolVLM / Idefics3's turns ("User: ...<end_of_utterance>\nAssistant:"); an image part is
# "<image>", which the vision tower expands (models/vision/).
SMOLVLM_TEMPLATE = (
    "<|im_start|>"
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}{{ ': ' + message['content'] }}"
    "{% else %}"
    "{{ ':' if message['content'] and message['content'][0]['type'] == 'image' else ': ' }}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}{{ '<image>' }}{% endif %}"
    "{% endfor %}{% endif %}"
    "<end_of_utterance>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

# Qwen2-VL / Qwen2.5-VL's ChatML turns, with Qwen's default system turn; an image part is
# <|vision_start|><|image_pad|><|vision_end|>, whose <|image_pad|> the vision tower expands.
QWEN_VL_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True, slots=True)
class ToolDialect:
    """How a family writes a tool call. `markers` is (start, end) for the parser; an empty end
    means the call runs to the next start marker or the end of the text (the parser reads a bare
    JSON answer, Llama 3's form, for every dialect). `tokens` are the markup pieces that are
    special tokens in the family's vocabulary, which detokenizing would otherwise drop before
    the parser sees them. `call_id_length`: the templates of this dialect insist on call ids of
    that length (Mistral's raise unless 9 alphanumerics), so the conversation's ids are rewritten
    to that form before rendering."""

    name: str
    markers: tuple[str, str] | None
    tokens: tuple[str, ...] = ()
    call_id_length: int | None = None
    python_list: bool = False  # a bare answer may be a Python list of calls (pythonic form)


LLAMA3_JSON = ToolDialect("llama3-json", None, tokens=("<|python_tag|>",))
# Llama 3.2's lightweight models (and Gemma 3's template of the same form) answer a call as a
# Python list, `[get_weather(city="Paris"), other(x=1)]`, with no markup around it; a bare JSON
# call (what a forced call's grammar writes) still reads as one.
PYTHONIC = ToolDialect("pythonic", None, tokens=("<|python_tag|>",), python_list=True)
HERMES = ToolDialect(
    "hermes", ("<tool_call>", "</tool_call>"), tokens=("<tool_call>", "</tool_call>")
)
MISTRAL = ToolDialect(
    "mistral", ("[TOOL_CALLS]", ""), ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"), call_id_length=9
)
# Phi-4-mini closes its list with <|/tool_call|>; Granite writes <|tool_call|>[...] and stops.
PHI = ToolDialect(
    "phi", ("<|tool_call|>", "<|/tool_call|>"), tokens=("<|tool_call|>", "<|/tool_call|>")
)
GEMMA_TOOL_CODE = ToolDialect(
    "tool_code", ("```tool_code", "```")
)  # Gemma: Python calls in a fence
THINK = ("<think>", "</think>")


@dataclass(frozen=True, slots=True)
class ReasoningDialect:
    """How a family writes its reasoning. `markers`: the (open, close) tags around it.
    `answer`: tags some families put around the answer that follows (Granite 3.3's
    `<response>`…`</response>`), dropped from the content. `switch`: the chat template variable
    that turns thinking on or off (`enable_thinking` for Qwen 3 and SmolLM3, Granite's
    `thinking`)."""

    markers: tuple[str, str]
    answer: tuple[str, str] | None = None
    switch: str = "enable_thinking"


THINKING = ReasoningDialect(THINK)
GRANITE_THINKING = ReasoningDialect(THINK, ("<response>", "</response>"), switch="thinking")


@dataclass(frozen=True, slots=True)
class Family:
    name: str
    chat_template: str | None  # used when the model's own files carry none
    eos_tokens: tuple[str, ...]  # end-of-turn tokens that end generation besides the model's EOS
    tool_dialect: ToolDialect = LLAMA3_JSON
    reasoning: ReasoningDialect | None = None
    # Reads images: a loaded model's record says True exactly when its vision tower was loaded
    # (models/loading/loader.py); a family record says whether its folders carry one.
    vision: bool = False
    system_role: bool = True  # False: the template refuses system turns (Gemma 2's raises)

    @property
    def reasoning_markers(self) -> tuple[str, str] | None:
        return self.reasoning.markers if self.reasoning is not None else None

    @property
    def thinking_switch(self) -> str:
        """The chat template variable a request's thinking on/off is passed as."""
        return self.reasoning.switch if self.reasoning is not None else "enable_thinking"

    @property
    def tool_call_markers(self) -> tuple[str, str] | None:
        return self.tool_dialect.markers

    @property
    def tool_call_id_length(self) -> int | None:
        return self.tool_dialect.call_id_length

    @property
    def markup_tokens(self) -> tuple[str, ...]:
        """Special tokens that carry markup (tool calls, reasoning): kept when detokenizing."""
        reasoning = self.reasoning_markers or ()
        answer = (self.reasoning.answer if self.reasoning is not None else None) or ()
        return tuple(dict.fromkeys((*self.tool_dialect.tokens, *reasoning, *answer)))


_QWEN_EOS = ("<|im_end|>", "<|endoftext|>")
_LLAMA_EOS = ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|im_end|>")

FAMILIES: dict[str, Family] = {
    # Llama 2/3.x and SmolLM2 (whose GGUF and folder say `llama`), and Mistral-as-llama GGUFs.
    "llama": Family("llama", CHATML_TEMPLATE, _LLAMA_EOS, LLAMA3_JSON),
    "mistral": Family("mistral", MISTRAL_TEMPLATE, ("</s>",), MISTRAL),
    "qwen2": Family("qwen2", CHATML_TEMPLATE, _QWEN_EOS, HERMES),
    "qwen3": Family("qwen3", CHATML_TEMPLATE, _QWEN_EOS, HERMES, THINKING),
    "qwen3moe": Family("qwen3moe", CHATML_TEMPLATE, _QWEN_EOS, HERMES, THINKING),
    "phi3": Family("phi3", PHI3_TEMPLATE, ("<|end|>", "<|endoftext|>"), PHI),
    "gemma2": Family(
        "gemma2", GEMMA_TEMPLATE, ("<end_of_turn>",), GEMMA_TOOL_CODE, system_role=False
    ),
    "gemma3": Family("gemma3", GEMMA_TEMPLATE, ("<end_of_turn>",), GEMMA_TOOL_CODE),
    "smollm3": Family("smollm3", CHATML_TEMPLATE, _QWEN_EOS, HERMES, THINKING),
    "granite": Family("granite", GRANITE_TEMPLATE, ("<|end_of_text|>",), PHI),
    # Idefics3 / SmolVLM folders: SigLIP and a connector before a Llama decoder.
    "smolvlm": Family("smolvlm", SMOLVLM_TEMPLATE, ("<end_of_utterance>",), vision=True),
    # Qwen2.5-VL: a windowed ViT and a patch merger before a Qwen2 decoder with M-RoPE.
    "qwen2_5_vl": Family("qwen2_5_vl", QWEN_VL_TEMPLATE, _QWEN_EOS, HERMES, vision=True),
}

# Hugging Face `model_type` and GGUF `general.architecture` spellings → canonical family name.
_ALIASES: dict[str, str] = {
    **{name: name for name in FAMILIES},
    "qwen3_moe": "qwen3moe",  # HF
    "gemma3_text": "gemma3",  # HF, Gemma 3 1B and the text tower of 4B+
    "idefics3": "smolvlm",  # HF, SmolVLM's predecessor: the same architecture
    "qwen2vl": "qwen2_5_vl",  # GGUF: llama.cpp's Qwen2-VL / Qwen2.5-VL text model
}


class UnsupportedArchitecture(ValueError):
    """A model whose architecture no family record covers."""

    def __init__(self, architecture: str) -> None:
        self.architecture = architecture
        supported = ", ".join(supported_architectures())
        super().__init__(f"architecture {architecture!r} is not supported (supported: {supported})")


def supported_architectures() -> list[str]:
    """Every accepted architecture name, HF and GGUF spellings alike, sorted."""
    return sorted(_ALIASES)


def family_for(architecture: str) -> Family:
    """The record for an HF `model_type` or GGUF `general.architecture`; refuses any other."""
    name = _ALIASES.get(architecture.strip().lower())
    if name is None:
        raise UnsupportedArchitecture(architecture)
    return FAMILIES[name]


# What a chat template (or, failing that, the vocabulary) says about the tool-call dialect, in the
# order they are tried: the first that appears wins. A Hermes fine-tune of Llama 3 keeps
# `<|python_tag|>` in its vocabulary but writes `<tool_call>` in its template, hence template first.
_TOOL_SIGNS: tuple[tuple[str, ToolDialect], ...] = (
    ("[func_name1(", PYTHONIC),  # the example call of the pythonic templates' instruction
    ("[TOOL_CALLS]", MISTRAL),
    ("<|tool_call|>", PHI),
    ("<tool_call>", HERMES),
    ("<|python_tag|>", LLAMA3_JSON),
    ("<|eom_id|>", LLAMA3_JSON),
    ("```tool_code", GEMMA_TOOL_CODE),
)
# The same for reasoning, template first: Granite 3.3's asks for `<think></think>` then
# `<response></response>`; any other `<think>` (template or vocabulary) is the plain form.
_REASONING_SIGNS: tuple[tuple[str, ReasoningDialect], ...] = (
    ("<response></response>", GRANITE_THINKING),
    (THINK[0], THINKING),
)


def family_for_model(
    architecture: str,
    chat_template: str | None,
    has_token: Callable[[str], bool] = lambda token: False,
) -> Family:
    """The architecture's record, with the tool-call and reasoning dialect the model itself
    declares: its chat template first, then its vocabulary's special tokens (`has_token`).
    Raises UnsupportedArchitecture for an architecture no record covers."""
    family = family_for(architecture)
    template = chat_template or ""
    dialect = next((d for sign, d in _TOOL_SIGNS if sign in template), None)
    if dialect is None:
        dialect = next((d for sign, d in _TOOL_SIGNS if has_token(sign)), family.tool_dialect)
    reasoning = family.reasoning
    if reasoning is None:
        reasoning = next((r for sign, r in _REASONING_SIGNS if sign in template), None)
    if reasoning is None and has_token(THINK[0]):
        reasoning = THINKING
    if dialect == family.tool_dialect and reasoning == family.reasoning:
        return family
    return dataclasses.replace(family, tool_dialect=dialect, reasoning=reasoning)
