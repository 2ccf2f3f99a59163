"""One capability record per model family; no other layer branches on a family name."""

from __future__ import annotations

from dataclasses import dataclass

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Gemma's turn format; system text is folded into the first user turn, as Google's template does.
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] + '\\n\\n' %}{% set rest = messages[1:] %}"
    "{% else %}{% set system = '' %}{% set rest = messages %}{% endif %}"
    "{% for message in rest %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' }}"
    "{% if loop.first %}{{ system }}{% endif %}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)


@dataclass(frozen=True, slots=True)
class Family:
    name: str
    chat_template: str | None  # used when the model's own files carry none
    eos_tokens: tuple[str, ...]  # end-of-turn tokens that end generation besides the model's EOS
    tool_call_markers: tuple[str, str] | None = None
    reasoning_markers: tuple[str, str] | None = None
    vision: bool = False


FAMILIES: dict[str, Family] = {
    "llama": Family("llama", CHATML_TEMPLATE, ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>")),
    "mistral": Family("mistral", None, ()),
    "qwen2": Family(
        "qwen2", CHATML_TEMPLATE, ("<|im_end|>", "<|endoftext|>"), ("<tool_call>", "</tool_call>")
    ),
    "qwen3": Family(
        "qwen3",
        CHATML_TEMPLATE,
        ("<|im_end|>", "<|endoftext|>"),
        ("<tool_call>", "</tool_call>"),
        ("<think>", "</think>"),
    ),
    # Gemma writes calls as Python in a ```tool_code fence (text/tool_calls.py reads them).
    "gemma3": Family("gemma3", GEMMA_TEMPLATE, ("<end_of_turn>",), ("```tool_code", "```")),
}


def family_for(model_type: str) -> Family:
    """The record for a config's model_type (HF `model_type` or GGUF `general.architecture`)."""
    key = model_type.lower()
    if key in ("gemma3_text", "gemma3"):
        key = "gemma3"
    return FAMILIES.get(key, FAMILIES["llama"])
