"""Incremental detokenization: token ids in, newly completed text out, never a broken character.

Decoding tokens one at a time goes wrong in two ways: byte-level tokens can end in the middle of a
UTF-8 character (decoding shows U+FFFD), and tokenizers that mark word starts (sentencepiece's
"▁", some BPE decoders) drop or add a leading space depending on what precedes a token. So, as in
vLLM and TGI (their prefix and read offsets), each step decodes a short window: the tokens last
returned, kept as context, then the pending ones. Whatever the window decodes to beyond the
context's own text is new, and is released only once it no longer ends in U+FFFD.
"""

from __future__ import annotations

from typing import Protocol

# Prompt tokens kept as context before the first generated token, so that it decodes with the
# spacing it has in the full text.
_CONTEXT_TOKENS = 5
# A UTF-8 character is at most 4 bytes, hence at most 4 byte tokens; a tail still undecodable after
# this many tokens will never decode, and holding it longer would only grow the window.
_MAX_PENDING_TOKENS = 16

_REPLACEMENT = "\ufffd"


class TokenDecoder(Protocol):
    """What the detokenizer needs: transformers' fast tokenizers and `tokenizers.Tokenizer` fit."""

    def decode(self, ids: list[int], /, *, skip_special_tokens: bool) -> str: ...


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: TokenDecoder,
        prompt_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # A short window: ids[:read] decode to text already returned (or prompt context) and are
        # kept only as context; ids[read:] are pending.
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:]) if prompt_ids else []
        self._read_offset = len(self._ids)
        self._context_text = self._decode(self._ids)

    def add(self, token_ids: list[int]) -> str:
        """Take new ids; return the text they complete ("" while a character is still split)."""
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        text = self._decode(self._ids)
        incomplete = text.endswith(_REPLACEMENT) or len(text) <= len(self._context_text)
        if incomplete and len(self._ids) - self._read_offset < _MAX_PENDING_TOKENS:
            return ""
        return self._advance(text)

    def flush(self) -> str:
        """Return whatever is still pending at the end of generation, complete or not."""
        if self._read_offset == len(self._ids):
            return ""
        return self._advance(self._decode(self._ids))

    def _advance(self, text: str) -> str:
        delta = text[len(self._context_text) :]
        # The tokens just returned become the context for the next ones and older ones are
        # dropped, so every step decodes a window of bounded length.
        del self._ids[: self._read_offset]
        self._read_offset = len(self._ids)
        self._context_text = self._decode(self._ids)
        return delta

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)
