"""The registry lists a sequence-classifier folder as a reranker, and one it cannot serve with
its reason, without loading either."""

from __future__ import annotations

import json
from pathlib import Path

from tiny_reranker import config_of, make_tiny_reranker

from modelhost.residency.registry import ModelRegistry


def registry_over(models: Path, root: Path) -> ModelRegistry:
    return ModelRegistry([models], home=root / "home", hf_hub=root / "hub", embedded=False)


def test_a_bert_sequence_classifier_folder_is_a_reranker_budgeted_by_its_weights(
    tmp_path: Path,
) -> None:
    make_tiny_reranker(tmp_path / "models" / "tiny-reranker")
    entry = registry_over(tmp_path / "models", tmp_path).get("tiny-reranker")
    assert entry is not None
    assert entry.operations == ("rerank",) and entry.refusal is None
    assert entry.estimate_bytes > entry.weights_bytes > 0


def test_an_xlm_roberta_reranker_is_listed_with_why_it_is_not_served(tmp_path: Path) -> None:
    folder = make_tiny_reranker(tmp_path / "models" / "xlmr-reranker")
    raw = config_of(folder)
    raw.update(model_type="xlm-roberta", architectures=["XLMRobertaForSequenceClassification"])
    (folder / "config.json").write_text(json.dumps(raw))
    entry = registry_over(tmp_path / "models", tmp_path).get("xlmr-reranker")
    assert entry is not None and entry.operations == ("rerank",)
    assert "XLMRobertaForSequenceClassification rerankers are not served yet" in (
        entry.refusal or ""
    )
