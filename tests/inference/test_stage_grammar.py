"""The stage's side of structured output: compile the request's grammar or refuse it with a 400
naming the problem; only with grammars switched off, fall back with a Warning and (for chat) an
instruction in the prompt."""

from __future__ import annotations

import dataclasses

import pytest
from scripted_engine import ScriptedEngine, scripted_model

from modelhost.inference.contracts import (
    ChatPrompt,
    GrammarSpec,
    InferenceRequest,
    InvalidRequest,
    TextPrompt,
)
from modelhost.inference.stage import InferenceStage

INSTRUCTION = "Respond only with JSON."


def chat_request(grammar: GrammarSpec) -> InferenceRequest:
    prompt = ChatPrompt(messages=({"role": "user", "content": "hi"},))
    return InferenceRequest(
        "r1", "chat", prompt, structured_output=INSTRUCTION, grammar=grammar, max_tokens=4
    )


async def admit(request: InferenceRequest) -> tuple[ScriptedEngine, InferenceStage, list[str]]:
    engine = ScriptedEngine()
    stage = InferenceStage(engine, scripted_model())  # type: ignore[arg-type]
    admitted = await stage.admit(request)
    admitted.cancel()
    return engine, stage, list(admitted.warnings)


def rendered(engine: ScriptedEngine, stage: InferenceStage) -> str:
    return stage.model.tokenizer.decode(engine.submissions[0].prompt_ids, False)


async def test_a_grammar_that_compiles_reaches_the_engine_without_warning_or_instruction() -> None:
    engine, stage, warnings = await admit(chat_request(GrammarSpec("json_object")))
    assert warnings == []
    assert engine.submissions[0].params.grammar is not None
    assert INSTRUCTION not in rendered(engine, stage)


async def test_a_grammar_that_fails_to_compile_is_a_400_naming_the_field_and_the_problem() -> None:
    engine = ScriptedEngine()
    stage = InferenceStage(engine, scripted_model())  # type: ignore[arg-type]
    spec = GrammarSpec("json_schema", '{"type": "bogus"}', field="response_format.json_schema")
    with pytest.raises(InvalidRequest) as caught:
        await stage.admit(chat_request(spec))
    message = caught.value.message
    assert caught.value.status == 400 and caught.value.param == "response_format"
    assert message.startswith("response_format.json_schema is not a valid grammar: ")
    assert "bogus" in message
    assert engine.submissions == []


async def test_a_text_prompt_whose_grammar_fails_to_compile_is_a_400_too() -> None:
    stage = InferenceStage(ScriptedEngine(), scripted_model())  # type: ignore[arg-type]
    request = InferenceRequest("r1", "text", TextPrompt("hi"), grammar=GrammarSpec("grammar", "?"))
    with pytest.raises(InvalidRequest, match=r"^guided_grammar is not a valid grammar: "):
        await stage.admit(request)


async def test_modelhost_grammar_0_disables_compilation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODELHOST_GRAMMAR", "0")
    engine, _, [warning] = await admit(chat_request(GrammarSpec("json_object")))
    assert "MODELHOST_GRAMMAR=0" in warning
    assert warning.endswith(" - falling back to prompt injection")
    assert engine.submissions[0].params.grammar is None


async def test_a_budget_the_context_cuts_below_the_shortest_answer_blames_the_context() -> None:
    # max_tokens=100 asks for plenty; the context leaves 3 tokens, fewer than the shortest
    # object: the 400 must not claim the client asked for 3.
    schema = '{"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}'
    spec = GrammarSpec("json_schema", schema, field="response_format.json_schema")
    request = dataclasses.replace(chat_request(spec), max_tokens=100)
    probe = ScriptedEngine()
    admitted = await InferenceStage(probe, scripted_model()).admit(request)  # type: ignore[arg-type]
    admitted.cancel()
    context = admitted.prompt_tokens + 3
    engine = ScriptedEngine(context_length=context)
    stage = InferenceStage(engine, scripted_model(context_length=context))  # type: ignore[arg-type]

    with pytest.raises(InvalidRequest) as caught:
        await stage.admit(request)

    assert caught.value.status == 400 and caught.value.body["code"] == "max_tokens_too_small"
    assert caught.value.message.startswith("only 3 tokens are left for the answer but ")
    assert engine.submissions == []
