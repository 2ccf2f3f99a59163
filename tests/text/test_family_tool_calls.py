"""Each family's tool-call and reasoning markup, split out of recorded streams.

Every stream is fed as recorded (markers as one special-token delta each), then one character at
a time, then in odd chunks: the split must come out identical, and no markup may reach the
content or the reasoning.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import tokenizers
from family_templates import template

from modelhost.inference.channels import OutputChannels
from modelhost.inference.contracts import ChatPrompt, CompletionEvent, InferenceRequest
from modelhost.models.families import Family, family_for_model
from modelhost.text.detokenizer import IncrementalDetokenizer
from modelhost.text.tokenizer import Tokenizer

TOOLS = tuple(
    {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    for name in ("get_weather", "get_time")
)
MARKUP = (
    "<tool_call>", "</tool_call>", "<|tool_call|>", "<|/tool_call|>", "[TOOL_CALLS]", "[ARGS]",
    "[CALL_ID]", "<|python_tag|>", "<think>", "</think>", "```tool_code", "<|",
)  # fmt: skip
PARIS = ("get_weather", {"city": "Paris"})

# (architecture, template fixture, recorded deltas, expected reasoning, content, calls)
RECORDED = {
    "llama3 json answer": (
        "llama", "llama3",
        ['{"', "name", '":', ' "', "get", "_weather", '",', ' "', "parameters", '":', ' {"',
         "city", '":', ' "', "Paris", '"}}'],
        "", "", [PARIS],
    ),
    "llama3 python tag": (
        "llama", "llama3",
        ["<|python_tag|>", '{"name": "get_weather", ', '"parameters": {"city": "Paris"}}'],
        "", "", [PARIS],
    ),
    "qwen2.5 two calls after prose": (
        "qwen2", "qwen2_5",
        ["Let me", " check.", "\n", "<tool_call>", "\n", '{"name": "get_weather", "arguments": ',
         '{"city": "Paris"}}', "\n", "</tool_call>", "\n", "<tool_call>", "\n",
         '{"name": "get_time", "arguments": {}}', "\n", "</tool_call>"],
        "", "Let me check.\n", [PARIS, ("get_time", {})],
    ),
    "qwen3 thinks then calls": (
        "qwen3", "qwen3",
        ["<think>", "\n", "The user", " wants the weather.", "\n", "</think>", "\n\n",
         "<tool_call>", "\n", '{"name": "get_weather", "arguments": {"city": "Paris"}}', "\n",
         "</tool_call>"],
        "The user wants the weather.\n", "", [PARIS],
    ),
    "mistral v3 list (a llama GGUF)": (
        "llama", "mistral",
        ["[TOOL_CALLS]", " [", '{"name": "get_weather", "arguments": {"city": "Paris"}', ', "id":',
         ' "abc123xyz"}', "]"],
        "", "", [PARIS],
    ),
    "mistral name[ARGS] per call": (
        "mistral", "mistral",
        ["[TOOL_CALLS]", "get", "_weather", "[ARGS]", '{"city": ', '"Paris"}', "[TOOL_CALLS]",
         "get_time", "[CALL_ID]", "a1b2c3d4e", "[ARGS]", "{}"],
        "", "", [PARIS, ("get_time", {})],
    ),
    "phi-4-mini closed list": (
        "phi3", "phi4_mini",
        ["<|tool_call|>", '[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
         "<|/tool_call|>"],
        "", "", [PARIS],
    ),
    "granite open list": (
        "granite", "granite",
        ["<|tool_call|>", '[{"arguments": {"city": "Paris"}, ', '"name": "get_weather"}]'],
        "", "", [PARIS],
    ),
    "gemma 2 tool_code fence": (
        "gemma2", "gemma2",
        ["```", "tool", "_code", "\n", "get_weather", '(city="Paris")', "\n", "```"],
        "", "", [PARIS],
    ),
    "smollm3 thinks then calls": (
        "smollm3", "smollm3",
        ["<think>", "\n", "Weather needs", " a tool.", "\n", "</think>", "\n", "<tool_call>",
         "\n", '{"name": "get_weather", "arguments": {"city": "Paris"}}', "\n", "</tool_call>"],
        "Weather needs a tool.\n", "", [PARIS],
    ),
    "smollm3 answers without tools": (
        "smollm3", "smollm3",
        ["It", " is", " sunny", " in [Paris]", " <", "3"],
        "", "It is sunny in [Paris] <3", [],
    ),
}  # fmt: skip


def family_of(architecture: str, fixture: str) -> Family:
    return family_for_model(architecture, template(fixture))


def split(family: Family, deltas: list[str]) -> tuple[str, str, list[tuple[str, object]]]:
    request = InferenceRequest("r", "chat", ChatPrompt(messages=(), tools=TOOLS))
    channels = OutputChannels.for_request(request, family, lambda: "<|im_start|>assistant\n")
    assert channels is not None
    reasoning, content = "", ""
    for delta in deltas:
        event = channels.apply(CompletionEvent(text=delta, num_tokens=1))
        reasoning, content = reasoning + event.reasoning, content + event.text
    last = channels.apply(CompletionEvent(finish_reason="stop"))
    calls = [(call.name, json.loads(call.arguments)) for call in last.tool_calls]
    return reasoning + last.reasoning, content + last.text, calls


def chunkings(deltas: list[str]) -> Iterator[list[str]]:
    text = "".join(deltas)
    yield deltas
    yield list(text)
    for size in (2, 3, 7):
        yield [text[i : i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("case", sorted(RECORDED))
def test_a_recorded_stream_splits_the_same_however_its_deltas_are_cut(case: str) -> None:
    architecture, fixture, deltas, reasoning, content, calls = RECORDED[case]
    family = family_of(architecture, fixture)

    for pieces in chunkings(deltas):
        assert split(family, pieces) == (reasoning, content, calls), pieces


@pytest.mark.parametrize("case", sorted(RECORDED))
def test_no_markup_reaches_the_content_or_the_reasoning_at_any_cut(case: str) -> None:
    architecture, fixture, deltas, *_ = RECORDED[case]
    family = family_of(architecture, fixture)

    for pieces in chunkings(deltas):
        reasoning, content, _ = split(family, pieces)
        assert not any(marker in reasoning + content for marker in MARKUP), pieces


def test_a_malformed_mistral_call_is_released_as_content_not_lost() -> None:
    family = family_of("mistral", "mistral")
    deltas = ["[TOOL_CALLS]", "get_weather", "[ARGS]", '{"city": "Par']

    reasoning, content, calls = split(family, deltas)

    assert calls == []
    assert content == '[TOOL_CALLS]get_weather[ARGS]{"city": "Par'


def test_a_call_to_a_tool_not_offered_stays_text_in_the_bare_json_form() -> None:
    family = family_of("llama", "llama3")
    answer = '{"name": "delete_everything", "parameters": {}}'

    assert split(family, list(answer)) == ("", answer, [])


def char_backend(specials: list[str]) -> tokenizers.Tokenizer:
    """One token per character, plus `specials` as special tokens (as model files mark them)."""
    vocab = {"<unk>": 0} | {chr(code): code - 31 for code in range(32, 127)}
    vocab["\n"] = len(vocab)
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = tokenizers.decoders.Fuse()
    backend.add_special_tokens([tokenizers.AddedToken(token, special=True) for token in specials])
    return backend


@pytest.mark.parametrize(
    ("architecture", "fixture", "specials", "generated"),
    [
        (
            "llama", "llama3", ["<|begin_of_text|>", "<|python_tag|>", "<|eot_id|>"],
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
        ),
        (
            "llama", "mistral", ["<s>", "[TOOL_CALLS]", "[ARGS]", "</s>"],
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}</s>',
        ),
        (
            "phi3", "phi4_mini", ["<|endoftext|>", "<|tool_call|>", "<|/tool_call|>", "<|end|>"],
            '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]<|/tool_call|>'
            "<|end|>",
        ),
    ],
)  # fmt: skip
def test_markup_written_as_special_tokens_survives_detokenizing_and_becomes_the_call(
    architecture: str, fixture: str, specials: list[str], generated: str
) -> None:
    family = family_of(architecture, fixture)
    backend = char_backend(specials)
    tokenizer = Tokenizer(
        backend,
        chat_template=None,
        eos_token_ids=[],
        add_bos_token=False,
        bos_token=None,
        eos_token=None,
        markup_tokens=family.markup_tokens,
    )
    prompt = backend.encode(f"{specials[0]}Weather in Paris?", add_special_tokens=False).ids
    detokenizer = IncrementalDetokenizer(tokenizer.stream_decoder, prompt)
    ids = backend.encode(generated, add_special_tokens=False).ids

    deltas = [detokenizer.add([token_id]) for token_id in ids] + [detokenizer.flush()]

    assert "".join(deltas) == generated.replace(specials[-1], "")  # end of turn: dropped
    assert split(family, deltas) == ("", "", [PARIS])


def test_special_tokens_that_are_no_markup_are_still_dropped_when_detokenizing() -> None:
    backend = char_backend(["<|begin_of_text|>", "<|python_tag|>", "<|eot_id|>"])
    tokenizer = Tokenizer(
        backend,
        chat_template=None,
        eos_token_ids=[],
        add_bos_token=False,
        bos_token=None,
        eos_token=None,
        markup_tokens=("<|python_tag|>",),
    )
    ids = backend.encode("<|begin_of_text|>hi<|python_tag|>x<|eot_id|>").ids

    assert tokenizer.stream_decoder.decode(ids, skip_special_tokens=True) == "hi<|python_tag|>x"
    assert tokenizer.decode(ids) == "hix"  # the plain decode is unchanged
