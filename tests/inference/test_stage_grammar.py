"""The stage's side of structured output: compile the request's grammar, or fall back with a
Warning and (for chat) an instruction in the prompt."""

from __future__ import annotations

import pytest
from scripted_engine import ScriptedEngine, scripted_model

from modelhost.inference.contracts import ChatPrompt, GrammarSpec, InferenceRequest, TextPrompt
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


async def test_a_grammar_that_fails_to_compile_falls_back_to_the_instruction_with_why() -> None:
    engine, stage, warnings = await admit(chat_request(GrammarSpec("regex", "(")))
    [warning] = warnings
    assert warning.startswith("grammar not enforced: ")
    assert warning.endswith(" - falling back to prompt injection")
    assert engine.submissions[0].params.grammar is None
    assert INSTRUCTION in rendered(engine, stage)


async def test_a_text_prompt_whose_grammar_fails_is_warned_as_unconstrained() -> None:
    request = InferenceRequest("r1", "text", TextPrompt("hi"), grammar=GrammarSpec("grammar", "?"))
    _, _, [warning] = await admit(request)
    assert warning.endswith(" - output is not constrained")


async def test_modelhost_grammar_0_disables_compilation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODELHOST_GRAMMAR", "0")
    engine, _, [warning] = await admit(chat_request(GrammarSpec("json_object")))
    assert "MODELHOST_GRAMMAR=0" in warning
    assert engine.submissions[0].params.grammar is None
