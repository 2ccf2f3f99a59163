"""Budget-aware closing: a grammar row whose tokens run out is steered onto the shortest valid
value, and the tracker's completions are ones the grammar engine itself accepts.

A byte vocabulary (token i is byte i, then a stop token) makes every prefix reachable, so a
random walk through the grammar's masks exercises the tracker on prefixes no model would write.
"""

from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import pytest
import torch
import xgrammar

from modelhost.engine.sampling.grammar_close import ClosePlan, TokenBytes
from modelhost.engine.sampling.sampler import RowSamplingState, sample
from modelhost.engine.sampling.sampling_params import SamplingParams
from modelhost.text.json_prefix import JsonPrefix
from modelhost.text.json_shape import shape_of

STOP = 256
VOCAB = [bytes([i]) for i in range(256)] + [b"</s>"]
PRINTABLE = [*range(0x20, 0x7F), 0xC3, 0xA9]  # ASCII and the bytes of "é"

TRIP = {
    "type": "object",
    "properties": {
        "destinations": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "nights": {"type": "integer"}},
                "required": ["city", "nights"],
            },
        },
        "notes": {"type": "string"},
    },
    "required": ["destinations", "notes"],
}
MIXED = {
    "type": "object",
    "properties": {
        "code": {"type": "integer", "minimum": 10, "maximum": 99},
        "kind": {"enum": ["x", "xy", 3, None]},
        "word": {"type": "string", "minLength": 3},
        "pair": {"type": "array", "items": {"type": "number"}, "minItems": 2},
        "flag": {"type": "boolean"},
        "maybe": {"type": ["integer", "null"], "minimum": -50, "maximum": -5},
    },
    "required": ["code", "kind", "word", "pair", "maybe"],
}
SCHEMAS = pytest.mark.parametrize(
    ("schema", "strict"),
    [(TRIP, True), (MIXED, True), ({"type": "object"}, False)],
    ids=["trip", "mixed", "free-object"],
)


@pytest.fixture(scope="module")
def compiler() -> xgrammar.GrammarCompiler:
    info = xgrammar.TokenizerInfo(
        VOCAB, xgrammar.VocabType.RAW, vocab_size=len(VOCAB), stop_token_ids=[STOP]
    )
    return xgrammar.GrammarCompiler(info, max_threads=1)


def compiled_for(
    compiler: xgrammar.GrammarCompiler, schema: Any, strict: bool
) -> xgrammar.CompiledGrammar:
    return compiler.compile_json_schema(
        json.dumps(schema), any_whitespace=False, strict_mode=strict
    )


def plan_for(schema: Any) -> ClosePlan:
    tokens = TokenBytes(VOCAB, lambda text: list(text.encode()), frozenset({STOP}))
    return ClosePlan.of(shape_of(schema), tokens)


def allowed_bytes(matcher: xgrammar.GrammarMatcher) -> list[int]:
    bitmask = xgrammar.allocate_token_bitmask(1, len(VOCAB))
    matcher.fill_next_token_bitmask(bitmask)
    logits = torch.zeros((1, len(VOCAB)))
    xgrammar.apply_token_bitmask_inplace(logits, bitmask)
    return [i for i in PRINTABLE if logits[0, i] == 0]


@SCHEMAS
def test_every_completion_of_a_random_prefix_is_taken_by_the_grammar_valid_and_bounded(
    compiler: xgrammar.GrammarCompiler, schema: Any, strict: bool
) -> None:
    grammar = compiled_for(compiler, schema, strict)
    growth = plan_for(schema).growth
    rng = random.Random(7)
    for _ in range(5):
        matcher = xgrammar.GrammarMatcher(grammar)
        state: JsonPrefix | None = JsonPrefix.start(shape_of(schema))
        written = b""
        longest = len(shape_of(schema).shortest() or b"")
        for _ in range(rng.randint(1, 60)):
            allowed = allowed_bytes(matcher)
            if matcher.is_completed() or not allowed:
                break
            byte = rng.choice(allowed)
            assert matcher.accept_token(byte)
            written += bytes([byte])
            assert state is not None
            state = state.feed(bytes([byte]))
            assert state is not None, f"the tracker refused {written!r}"
            close = state.completion()
            assert close is not None
            assert len(close) <= longest + growth, "a byte grew the completion past the bound"
            longest = len(close)
            trial = matcher.fork()
            assert trial.accept_string(close) and trial.is_completed(), (written, close)
            value = json.loads((written + close).decode(), strict=False)
            jsonschema.validate(value, schema)


def generate(
    compiled: xgrammar.CompiledGrammar, plan: ClosePlan, favoured: bytes, max_tokens: int
) -> tuple[bytes, bool]:
    """What a row writes when its model always prefers `favoured`'s bytes (a string that
    never ends): the bytes, and whether its grammar holds a whole value at the end."""
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, grammar=compiled, grammar_close=plan
    )
    row = RowSamplingState.create(params, [0])
    assert row.grammar is not None
    written = b""
    while len(row.output_ids) < max_tokens and not row.grammar.is_terminated:
        logits = torch.zeros((1, len(VOCAB)))
        for rank, byte in enumerate(favoured):
            logits[0, byte] = 10.0 - rank * 0.1
        logits[0, STOP] = -5.0
        (token,) = sample(logits, [row])
        row.output_ids.append(token.token_id)
        row.grammar.accept(token.token_id)
        if token.token_id != STOP:
            written += VOCAB[token.token_id]
    return written, row.grammar.is_complete


@pytest.mark.parametrize("max_tokens", [33, 34, 40, 57, 128])
def test_a_row_that_would_never_close_ends_with_a_valid_value_within_its_budget(
    compiler: xgrammar.GrammarCompiler, max_tokens: int
) -> None:
    # Left alone this model opens an object in the array and writes "a" into its city forever.
    written, complete = generate(
        compiled_for(compiler, TRIP, True), plan_for(TRIP), b'{"[ac', max_tokens
    )
    assert complete
    assert len(written) <= max_tokens
    jsonschema.validate(json.loads(written), TRIP)


def test_the_shortest_value_in_tokens_is_what_admission_measures(
    compiler: xgrammar.GrammarCompiler,
) -> None:
    tokens = plan_for(TRIP).shortest_tokens(compiled_for(compiler, TRIP, True))
    assert tokens is not None
    assert bytes(tokens) == b'{"destinations": [], "notes": ""}'


def test_a_shortest_value_the_grammar_refuses_is_not_trusted(
    compiler: xgrammar.GrammarCompiler,
) -> None:
    # A shape that disagrees with the grammar (here: a bound it does not know) would force
    # text the grammar refuses; the check against the grammar catches it before any row does.
    grammar = compiled_for(compiler, {"type": "integer", "minimum": 5}, True)
    assert plan_for({"type": "integer"}).shortest_tokens(grammar) is None
