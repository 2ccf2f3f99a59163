"""A model's own files pick its dialect at load: a `llama` checkpoint whose template and
vocabulary are Mistral's parses `[TOOL_CALLS]`, keeps that special token through detokenizing
and gets nine-character call ids in its prompt; the family's end-of-turn tokens that its
vocabulary holds end generation."""

from __future__ import annotations

import json

import pytest
import tokenizers
from family_templates import template
from tiny_models import make_tiny_checkpoint

from modelhost.inference.contracts import ChatPrompt, InferenceRequest
from modelhost.inference.prompt import prompt_ids_for
from modelhost.models.families import MISTRAL
from modelhost.models.loaded import LoadedModel
from modelhost.models.loading.loader import load_model
from modelhost.text.detokenizer import IncrementalDetokenizer

pytestmark = pytest.mark.slow

MARKUP = ["[TOOL_CALLS]", "[ARGS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]
END_OF_MESSAGE = "<|eom_id|>"  # Llama 3's end of a tool-calling turn, not the file's EOS


@pytest.fixture(scope="module")
def mistral_like(smollm2: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    directory = make_tiny_checkpoint(tmp_path_factory.mktemp("mistral-like"), "llama", smollm2)
    backend = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    added = [*MARKUP, END_OF_MESSAGE]
    backend.add_special_tokens([tokenizers.AddedToken(token, special=True) for token in added])
    backend.save(str(directory / "tokenizer.json"))
    settings = json.loads((directory / "tokenizer_config.json").read_text())
    settings["chat_template"] = template("mistral")
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    return load_model(str(directory), quantize="none")


def test_the_template_names_the_dialect_of_a_llama_checkpoint(mistral_like: LoadedModel) -> None:
    assert mistral_like.family.name == "llama"
    assert mistral_like.family.tool_dialect == MISTRAL


def test_the_dialects_special_tokens_survive_detokenizing(mistral_like: LoadedModel) -> None:
    tokenizer = mistral_like.tokenizer
    ids = tokenizer.encode(
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', add_special_tokens=False
    )
    detokenizer = IncrementalDetokenizer(tokenizer.stream_decoder)

    text = "".join(detokenizer.add([token_id]) for token_id in ids) + detokenizer.flush()

    assert text == '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
    assert tokenizer.decode(ids) == 'get_weather{"city": "Paris"}'  # what it was before


def test_the_prompt_carries_nine_character_call_ids(mistral_like: LoadedModel) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": {}}}
    messages = (
        {"role": "user", "content": "Go"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "done"},
    )
    request = InferenceRequest("r", "chat", ChatPrompt(messages=messages))

    rendered = mistral_like.tokenizer.decode(prompt_ids_for(mistral_like, request), False)

    assert '"call_id": "' in rendered and "call_1" not in rendered


def test_the_familys_end_of_turn_tokens_end_generation(mistral_like: LoadedModel) -> None:
    tokenizer = mistral_like.tokenizer

    assert tokenizer.token_id(END_OF_MESSAGE) in tokenizer.eos_token_ids
