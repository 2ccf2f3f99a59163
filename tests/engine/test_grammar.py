"""Grammar-constrained sampling: the mask a row's grammar puts on its logits, and what it yields."""

from __future__ import annotations

import json

import pytest
import torch
import xgrammar

from modelhost.engine.engine import Engine, EngineConfig
from modelhost.engine.sampling.grammar_masks import GrammarState, apply_masks
from modelhost.engine.sampling.sampler import RowSamplingState, sample
from modelhost.engine.sampling.sampling_params import SamplingParams
from modelhost.inference.contracts import GrammarSpec
from modelhost.inference.grammars.compiler import GrammarInvalid, ModelGrammars
from modelhost.models.loaded import LoadedModel

# A four-token vocabulary, padded to 40 logits as models pad their embeddings.
VOCAB = ["a", "b", "c", "</s>"]
EOS = 3
PADDED = 40
A, B, C = 0, 1, 2

PERSON = {
    "type": "object",
    "properties": {
        "alive": {"type": "boolean"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog"]},
    },
    "required": ["alive", "age", "pet"],
}


@pytest.fixture(scope="module")
def ab_grammar() -> xgrammar.CompiledGrammar:
    """Exactly "ab", then end of sequence."""
    info = xgrammar.TokenizerInfo(VOCAB, vocab_size=PADDED, stop_token_ids=[EOS])
    return xgrammar.GrammarCompiler(info, max_threads=1).compile_grammar('root ::= "a" "b"')


@pytest.fixture(scope="module")
def smollm2_grammars(smollm2: LoadedModel) -> ModelGrammars:
    return ModelGrammars(smollm2)


def favour(token_id: int, rows: int) -> torch.Tensor:
    logits = torch.zeros((rows, PADDED))
    logits[:, token_id] = 10.0
    return logits


def test_only_rows_with_a_grammar_are_masked_in_a_mixed_batch(ab_grammar) -> None:
    logits = favour(C, rows=3)
    untouched = logits.clone()
    apply_masks(logits, [None, GrammarState(ab_grammar), None])
    assert torch.equal(logits[0], untouched[0]) and torch.equal(logits[2], untouched[2])
    assert torch.isfinite(logits[1]).tolist() == [i == A for i in range(PADDED)]


def test_greedy_and_sampled_rows_both_take_only_what_the_grammar_allows(ab_grammar) -> None:
    rows = [
        RowSamplingState.create(SamplingParams(temperature=0.0), [1]),
        RowSamplingState.create(SamplingParams(temperature=0.0, grammar=ab_grammar), [1]),
        RowSamplingState.create(SamplingParams(temperature=1.0, seed=1, grammar=ab_grammar), [1]),
    ]
    tokens = [t.token_id for t in sample(favour(C, rows=3), rows)]
    assert tokens == [C, A, A]


def test_a_grammar_row_is_terminated_once_it_accepts_its_stop_token(ab_grammar) -> None:
    state = GrammarState(ab_grammar)
    for token_id in (A, B):
        state.accept(token_id)
        assert not state.is_terminated
    state.accept(EOS)
    assert state.is_terminated


def test_a_json_schema_grammar_turns_random_logits_into_json_that_validates(
    smollm2: LoadedModel, smollm2_grammars: ModelGrammars
) -> None:
    compiled = smollm2_grammars.compile_sync(GrammarSpec("json_schema", json.dumps(PERSON)))
    row = RowSamplingState.create(SamplingParams(temperature=1.0, seed=7, grammar=compiled), [1])
    generator = torch.Generator().manual_seed(7)
    vocab = smollm2.config.vocab_size
    for _ in range(200):
        [token] = sample(torch.randn((1, vocab), generator=generator) * 5, [row])
        row.output_ids.append(token.token_id)
        row.grammar.accept(token.token_id)
        if row.grammar.is_terminated:
            break
    assert row.output_ids[-1] in smollm2.tokenizer.eos_token_ids
    value = json.loads(smollm2.tokenizer.decode(row.output_ids))
    assert isinstance(value["alive"], bool)
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 120
    assert value["pet"] in ("cat", "dog")


def test_a_malformed_schema_fails_to_compile_with_a_one_line_reason(
    smollm2_grammars: ModelGrammars,
) -> None:
    with pytest.raises(GrammarInvalid) as caught:
        smollm2_grammars.compile_sync(GrammarSpec("json_schema", '{"type": "bogus"}'))
    assert "bogus" in str(caught.value) and "\n" not in str(caught.value)


async def test_engine_ends_a_guided_choice_row_with_stop_on_one_of_the_choices(
    smollm2: LoadedModel, smollm2_grammars: ModelGrammars
) -> None:
    choices = ("red", "green", "blue")
    compiled = smollm2_grammars.compile_sync(GrammarSpec("choice", choices=choices))
    prompt = smollm2.tokenizer.encode_chat(
        [{"role": "user", "content": "Name a colour."}], add_generation_prompt=True
    )
    engine = Engine(smollm2, EngineConfig(batch=2))
    try:
        free = engine.submit(prompt, SamplingParams(temperature=0.0, max_tokens=8))
        stream = engine.submit(
            prompt, SamplingParams(temperature=1.0, seed=3, max_tokens=32, grammar=compiled)
        )
        events = [event async for event in stream]
        [event async for event in free]
    finally:
        engine.close()
    assert "".join(event.text for event in events) in choices
    assert events[-1].finish_reason == "stop"
