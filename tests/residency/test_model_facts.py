"""What a model's files say of it without loading it (what Ollama's /api/tags and /api/show
report)."""

from __future__ import annotations

from pathlib import Path

import pytest

from modelhost.residency.model_facts import model_facts
from modelhost.residency.registry import ModelRegistry


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> ModelRegistry:
    root: Path = tmp_path_factory.mktemp("facts")
    return ModelRegistry([], home=root / "home", hf_hub=root / "hub")


def test_a_gguf_gives_its_parameters_quantization_context_and_template(
    registry: ModelRegistry,
) -> None:
    entry = registry.get("smollm2-135m-instruct")
    assert entry is not None
    facts = model_facts(entry)
    assert facts.parameter_count is not None and 130e6 < facts.parameter_count < 140e6
    assert facts.quantization == "Q4_1"
    assert facts.context_length == 8192 and facts.embedding_length == 576
    assert facts.chat_template and "im_start" in facts.chat_template
    assert not facts.reasoning and not facts.vision
    assert facts.metadata["general.architecture"] == "llama"
    assert not any(key.startswith("tokenizer.") for key in facts.metadata)


def test_an_encoder_folder_gives_its_size_and_no_template(registry: ModelRegistry) -> None:
    entry = registry.get("all-minilm-l6-v2")
    assert entry is not None
    facts = model_facts(entry)
    assert facts.parameter_count is not None and 20e6 < facts.parameter_count < 25e6
    assert facts.chat_template is None and facts.embedding_length == 384
