"""A model left to choose under the built-in tool prompt writes free text, and once it opens a
call, the grammar holds the call to its tool's schema or format (SmolLM2's own vocabulary)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import xgrammar

from modelhost.inference.grammars.compiler import ModelGrammars
from modelhost.inference.grammars.tool_choice import forced_call, lazy_tool_grammar
from modelhost.models.loaded import LoadedModel

pytestmark = pytest.mark.slow

APPLY_PATCH_LARK = (Path(__file__).parent.parent / "fixtures" / "apply_patch.lark").read_text()
WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
APPLY_PATCH: dict[str, Any] = {
    "type": "custom",
    "custom": {
        "name": "apply_patch",
        "format": {"type": "grammar", "syntax": "lark", "definition": APPLY_PATCH_LARK},
    },
}
PATCH = (
    "*** Begin Patch\n*** Update File: a.py\n@@ def f():\n-    return 1\n+    return 2\n"
    "*** End Patch\n"
)


@pytest.fixture(scope="module")
def grammars(smollm2: LoadedModel) -> ModelGrammars:
    return ModelGrammars(smollm2)


def accepted(grammars: ModelGrammars, tools: list[dict[str, Any]], text: str) -> bool:
    spec = lazy_tool_grammar(tools)
    assert spec is not None
    matcher = xgrammar.GrammarMatcher(grammars.compile_sync(spec))
    return bool(matcher.accept_string(text))


def test_free_text_and_a_whole_call_both_pass(grammars: ModelGrammars) -> None:
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert accepted(grammars, [WEATHER], "Let me check the weather.")
    assert accepted(grammars, [WEATHER], f"Let me check.{call} Done.")


def test_an_opened_call_cannot_name_a_tool_that_was_not_offered(grammars: ModelGrammars) -> None:
    assert not accepted(grammars, [WEATHER], '<tool_call>\n{"name": "delete_everything"')


def test_an_opened_call_is_held_to_the_tools_schema(grammars: ModelGrammars) -> None:
    opened = '<tool_call>\n{"name": "get_weather", "arguments": '
    assert not accepted(grammars, [WEATHER], opened + '{"city": 5')
    assert not accepted(grammars, [WEATHER], opened + '{"town": "Paris"')


def test_an_opened_apply_patch_input_is_held_to_codexs_lark_grammar(
    grammars: ModelGrammars,
) -> None:
    opened = '<tool_input name="apply_patch">\n'
    assert accepted(grammars, [WEATHER, APPLY_PATCH], f"{opened}{PATCH}</tool_input>")
    assert not accepted(grammars, [WEATHER, APPLY_PATCH], f"{opened}*** Begin Patch\nrm -rf /\n")
    assert not accepted(grammars, [APPLY_PATCH], f"{opened}*** Begin Patch\n*** End Patch\n")


def test_a_forced_freeform_call_is_its_input_block_and_nothing_else(
    grammars: ModelGrammars, smollm2: LoadedModel
) -> None:
    spec, _ = forced_call([WEATHER, APPLY_PATCH], "apply_patch")
    compiled = grammars.compile_sync(spec)
    prose = xgrammar.GrammarMatcher(compiled)
    assert not prose.accept_string("Sure, here is the patch.")
    block = xgrammar.GrammarMatcher(compiled)
    assert block.accept_string(f'<tool_input name="apply_patch">\n{PATCH}</tool_input>')
    [end_of_turn] = smollm2.tokenizer.eos_token_ids
    assert block.accept_token(end_of_turn)


def test_a_regex_format_holds_a_freeform_input_to_the_pattern(grammars: ModelGrammars) -> None:
    tool = {
        "type": "custom",
        "custom": {
            "name": "code",
            "format": {"type": "grammar", "syntax": "regex", "definition": "[0-9]{3}"},
        },
    }
    assert accepted(grammars, [tool], '<tool_input name="code">\n123</tool_input>')
    assert not accepted(grammars, [tool], '<tool_input name="code">\n12a')
