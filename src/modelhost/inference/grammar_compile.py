"""Compiling a request's GrammarSpec into an xgrammar grammar for one model.

`ModelGrammars` belongs to a stage (one model). Its xgrammar GrammarCompiler, and the
TokenizerInfo behind it, are built on first use: that scans the whole vocabulary (seconds), so
it happens off the event loop and once. The compiler caches compiled grammars itself, so a
schema sent again compiles in microseconds.

A grammar that fails to compile is the request's fault: `GrammarInvalid`, which the stage turns
into a 400 naming the problem. Only when no grammar can be compiled at all (the operator set
`MODELHOST_GRAMMAR=0`, or the install lacks the engine) is it `GrammarUnavailable`, and the caller
falls back to prompt injection and a Warning carrying `hint()`.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
from typing import TYPE_CHECKING

from modelhost.inference.contracts import GrammarSpec
from modelhost.models.loaded import LoadedModel

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar, GrammarCompiler

ENV_SWITCH = "MODELHOST_GRAMMAR"
_MAX_HINT = 200
_MAX_REASON = 500
# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "; the rest is the reason.
_CPP_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")


class GrammarUnavailable(Exception):
    """No grammar can be enforced on this server; str() is a short, header-safe reason."""


class GrammarInvalid(Exception):
    """The request's grammar does not compile; str() is a one-line reason."""


def grammar_enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip() != "0"


class ModelGrammars:
    def __init__(self, model: LoadedModel) -> None:
        self.model = model
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    async def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar; GrammarInvalid when the spec is wrong, GrammarUnavailable when
        this server compiles no grammars."""
        if not grammar_enabled():
            raise GrammarUnavailable(f"disabled by {ENV_SWITCH}=0")
        return await asyncio.to_thread(self.compile_sync, spec)

    def compile_sync(self, spec: GrammarSpec) -> CompiledGrammar:
        compiler = self._compiler_for_model()
        try:
            return _compile(compiler, spec)
        except GrammarInvalid:
            raise
        except Exception as exc:  # xgrammar reports bad input as RuntimeError/ValueError
            raise GrammarInvalid(hint(exc, limit=_MAX_REASON)) from exc

    def _compiler_for_model(self) -> GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                try:
                    self._compiler = _build_compiler(self.model)
                except GrammarUnavailable:
                    raise
                except Exception as exc:  # a tokenizer xgrammar cannot read: no grammars here
                    raise GrammarUnavailable(hint(exc)) from exc
            return self._compiler


def _build_compiler(model: LoadedModel) -> GrammarCompiler:
    try:
        import transformers
        import xgrammar
    except ImportError as exc:  # an install without the optional engine degrades, never fails
        raise GrammarUnavailable("no grammar engine") from exc
    tokenizer = model.tokenizer
    wrapped = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
    # The logits may be wider than the tokenizer (padded embeddings); the mask must cover them.
    vocab_size = max(int(model.config.vocab_size or 0), tokenizer.vocab_size)
    info = xgrammar.TokenizerInfo.from_huggingface(
        wrapped, vocab_size=vocab_size, stop_token_ids=sorted(tokenizer.eos_token_ids) or None
    )
    # Few threads: compilation shares the CPU with the engine's step loop.
    return xgrammar.GrammarCompiler(info, max_threads=2)


def _compile(compiler: GrammarCompiler, spec: GrammarSpec) -> CompiledGrammar:
    # Compact JSON: a free-whitespace grammar lets a small model pad forever with newlines.
    if spec.kind == "grammar":
        return compiler.compile_grammar(spec.source)
    if spec.kind == "json_schema":
        return compiler.compile_json_schema(spec.source, any_whitespace=False, strict_mode=True)
    if spec.kind == "json_object":
        return compiler.compile_json_schema(
            '{"type": "object"}', any_whitespace=False, strict_mode=False
        )
    if spec.kind == "regex":
        return compiler.compile_regex(spec.source)
    if spec.kind == "choice":
        if not spec.choices:
            raise GrammarInvalid("guided_choice is empty")
        literals = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in spec.choices)
        return compiler.compile_grammar(f"root ::= {literals}")
    raise GrammarInvalid(f"unknown grammar kind {spec.kind!r}")


def hint(exc: BaseException, *, limit: int = _MAX_HINT) -> str:
    """A one-line, ASCII reason for a Warning header (headers are latin-1, one line)."""
    text = str(exc).strip() or type(exc).__name__
    text = _CPP_PREFIX.sub("", text.splitlines()[0] if text else text)
    text = text.encode("ascii", "replace").decode("ascii")
    text = "".join(ch if ch.isprintable() else " " for ch in text)
    return text[:limit]
