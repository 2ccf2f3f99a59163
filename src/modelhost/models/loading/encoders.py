"""Loading an encoder companion by what its files are: a sentence encoder (a BERT-family or
NomicBERT folder, or a "bert" GGUF) or a reranker (a classifier folder, or a GGUF with its
classifier head). The registry decided which it is (residency/registry.py)."""

from __future__ import annotations

import json
from pathlib import Path

from modelhost.models.networks.bert import EmbeddingModel
from modelhost.models.networks.cross_encoder import CrossEncoderModel


def load_sentence_encoder(path: Path, model_id: str | None = None) -> EmbeddingModel:
    if path.suffix == ".gguf":
        from modelhost.models.loading.encoder_gguf import load_gguf_encoder

        return load_gguf_encoder(path, model_id)
    if json.loads((path / "config.json").read_text()).get("model_type") == "nomic_bert":
        from modelhost.models.networks.nomic_bert import load_nomic_bert

        return load_nomic_bert(path, model_id)
    from modelhost.models.networks.bert import load_bert

    return load_bert(path, model_id)


def load_reranker(path: Path, model_id: str | None = None) -> CrossEncoderModel:
    if path.suffix == ".gguf":
        from modelhost.models.loading.encoder_gguf import load_gguf_reranker

        return load_gguf_reranker(path, model_id)
    from modelhost.models.networks.cross_encoder import load_cross_encoder

    return load_cross_encoder(path, model_id)
