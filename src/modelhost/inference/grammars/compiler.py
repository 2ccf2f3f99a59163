"""Compiling a request's GrammarSpec into an xgrammar grammar for one model.

`ModelGrammars` belongs to a stage (one model). Its xgrammar GrammarCompiler, and the
TokenizerInfo behind it, are built on first use: that scans the whole vocabulary (seconds), so
it happens off the event loop and once. The compiler caches compiled grammars itself, so a
schema sent again compiles in microseconds.

A grammar that fails to compile is the request's fault: `GrammarInvalid`, which the stage turns
into a 400 naming the problem. Only when no grammar can be compiled at all (the operator set
`MODELHOST_GRAMMAR=0`, or the install lacks the engine) is it `GrammarUnavailable`, and the caller
falls back to prompt injection and a Warning carrying `hint()`.

`closing` pairs a compiled grammar with its `ClosePlan` (the engine's budget-aware closing) and
the fewest tokens its shortest valid value takes, for the kinds whose shortest value is known
(a JSON schema, json_object, a choice); a regex or free grammar gets none.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from modelhost.engine.sampling.grammar_close import ClosePlan, TokenBytes
from modelhost.inference.contracts import GrammarSpec, InvalidRequest
from modelhost.models.loaded import LoadedModel
from modelhost.text.json_shape import Shape, ShapeUnsupported, choice_shape, shape_of

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar, GrammarCompiler

log = logging.getLogger(__name__)

ENV_SWITCH = "MODELHOST_GRAMMAR"
_MAX_HINT = 200
_MAX_REASON = 500
# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "; the rest is the reason.
_CPP_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")


class GrammarUnavailable(Exception):
    """No grammar can be enforced on this server; str() is a short, header-safe reason."""


class GrammarInvalid(Exception):
    """The request's grammar does not compile; str() is a one-line reason."""


@dataclass(frozen=True, slots=True)
class Closing:
    """How a compiled grammar's value closes in budget, and the fewest tokens it can take."""

    plan: ClosePlan
    min_tokens: int


def grammar_enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip() != "0"


class ModelGrammars:
    def __init__(self, model: LoadedModel) -> None:
        self.model = model
        self._compiler: GrammarCompiler | None = None
        self._tokens: TokenBytes | None = None  # built with the first closing plan
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

    async def closing(self, spec: GrammarSpec, compiled: CompiledGrammar) -> Closing | None:
        """The closing plan for `spec`'s grammar; None when its shortest value is not known."""
        return await asyncio.to_thread(self.closing_sync, spec, compiled)

    def closing_sync(self, spec: GrammarSpec, compiled: CompiledGrammar) -> Closing | None:
        try:
            shape = _shape(spec)
        except ShapeUnsupported as exc:
            log.info("no closing guarantee for this %s: %s", spec.kind, exc)
            return None
        except Exception as exc:  # a schema the grammar took in a form the shapes do not read
            log.warning("no closing guarantee for this %s: %r", spec.kind, exc)
            return None
        if shape is None:
            return None
        plan = ClosePlan.of(shape, self._token_bytes(compiled))
        tokens = plan.shortest_tokens(compiled)
        if tokens is None:
            log.warning("grammar refuses the shortest %s value; no closing guarantee", spec.kind)
            return None
        return Closing(plan, max(1, len(tokens)))

    def _token_bytes(self, compiled: CompiledGrammar) -> TokenBytes:
        with self._lock:
            if self._tokens is None:
                info = compiled.tokenizer_info
                tokenizer = self.model.tokenizer
                self._tokens = TokenBytes(
                    info.decoded_vocab,
                    lambda text: tokenizer.encode(text, add_special_tokens=False),
                    frozenset(info.special_token_ids) | frozenset(info.stop_token_ids),
                )
            return self._tokens

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
    if spec.kind == "structural_tag":
        return compiler.compile_structural_tag(spec.source)
    if spec.kind == "choice":
        if not spec.choices:
            raise GrammarInvalid("guided_choice is empty")
        literals = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in spec.choices)
        return compiler.compile_grammar(f"root ::= {literals}")
    raise GrammarInvalid(f"unknown grammar kind {spec.kind!r}")


def budget_refusal(
    spec: GrammarSpec, min_tokens: int, max_tokens: int, *, requested: bool, field: str
) -> InvalidRequest | None:
    """The 400 for a budget too small for the shortest valid answer; None when it fits."""
    if max_tokens >= min_tokens:
        return None
    if spec.field == "tools":  # a forced call (tool_choice)
        shortest = f"the shortest tool call that tool_choice forces takes {min_tokens} tokens"
    else:
        what = spec.field or "the response format"
        shortest = f"the shortest answer that satisfies {what} takes {min_tokens} tokens"
    if requested:
        message = f"{field} is {max_tokens} but {shortest}; set {field} to at least {min_tokens}"
    else:
        message = (
            f"only {max_tokens} tokens are left for the answer but {shortest}; "
            "shorten the prompt or raise the server's limits"
        )
    return InvalidRequest(message, param=field, code="max_tokens_too_small")


def _shape(spec: GrammarSpec) -> Shape | None:
    if spec.kind == "json_schema":
        return shape_of(spec.source)
    if spec.kind == "json_object":
        return shape_of({"type": "object"})
    if spec.kind == "choice":
        return choice_shape(spec.choices)
    return None  # a regex or a free grammar: no shortest value known


def hint(exc: BaseException, *, limit: int = _MAX_HINT) -> str:
    """A one-line, ASCII reason for a Warning header (headers are latin-1, one line)."""
    text = str(exc).strip() or type(exc).__name__
    text = _CPP_PREFIX.sub("", text.splitlines()[0] if text else text)
    text = text.encode("ascii", "replace").decode("ascii")
    text = "".join(ch if ch.isprintable() else " " for ch in text)
    return text[:limit]
