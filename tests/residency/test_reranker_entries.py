"""The registry lists a sequence-classifier folder (BERT, XLM-R) or GGUF as a reranker, an
encoder GGUF as an embedder, and what it cannot serve with its reason, without loading any."""

from __future__ import annotations

import json
from pathlib import Path

from tiny_encoders import make_xlmr_encoder, make_xlmr_reranker
from tiny_gguf_encoders import write_encoder_gguf
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


def test_an_xlm_roberta_sequence_classifier_folder_is_a_reranker(tmp_path: Path) -> None:
    make_xlmr_reranker(tmp_path / "models" / "xlmr-reranker")
    entry = registry_over(tmp_path / "models", tmp_path).get("xlmr-reranker")
    assert entry is not None
    assert entry.operations == ("rerank",) and entry.refusal is None


def test_a_distilbert_reranker_is_listed_with_why_it_is_not_served(tmp_path: Path) -> None:
    folder = make_tiny_reranker(tmp_path / "models" / "distil-reranker")
    raw = config_of(folder)
    raw.update(model_type="distilbert", architectures=["DistilBertForSequenceClassification"])
    (folder / "config.json").write_text(json.dumps(raw))
    entry = registry_over(tmp_path / "models", tmp_path).get("distil-reranker")
    assert entry is not None and entry.operations == ("rerank",)
    assert "DistilBertForSequenceClassification rerankers are not served yet" in (
        entry.refusal or ""
    )


def test_a_gguf_converted_from_a_classifier_is_a_reranker_and_from_an_encoder_an_embedder(
    tmp_path: Path,
) -> None:
    models = tmp_path / "models"
    models.mkdir()
    write_encoder_gguf(make_xlmr_reranker(tmp_path / "reranker"), models / "reranker.gguf")
    write_encoder_gguf(make_xlmr_encoder(tmp_path / "encoder"), models / "encoder.gguf")
    registry = registry_over(models, tmp_path)
    reranker, encoder = registry.get("reranker"), registry.get("encoder")
    assert reranker is not None and reranker.operations == ("rerank",)
    assert encoder is not None and encoder.operations == ("embed",)
    assert reranker.refusal is None and encoder.refusal is None
    assert reranker.format == encoder.format == "gguf"


def test_a_sentence_encoder_with_a_dense_module_is_listed_with_why_it_is_not_served(
    tmp_path: Path,
) -> None:
    folder = make_xlmr_encoder(tmp_path / "models" / "dense-encoder")
    modules = json.loads((folder / "modules.json").read_text())
    dense = {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}
    (folder / "modules.json").write_text(json.dumps([*modules, dense]))
    entry = registry_over(tmp_path / "models", tmp_path).get("dense-encoder")
    assert entry is not None and entry.operations == ("embed",)
    assert "modules ['Dense'] are not supported" in (entry.refusal or "")
