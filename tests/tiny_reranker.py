"""A tiny random cross-encoder made with transformers' own classes: BertForSequenceClassification
with one label, saved with all-MiniLM-L6-v2's real tokenizer files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from modelhost.models.loading.embedded import EMBEDDED_ENCODERS, EMBEDDING_MODEL

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "special_tokens_map.json",
)


def make_tiny_reranker(path: Path, *, max_positions: int = 512, **config: Any) -> Path:
    """A BertForSequenceClassification folder at `path` (random weights, seeded)."""
    import torch
    import transformers

    torch.manual_seed(0)
    bert_config = transformers.BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=max_positions,
        num_labels=1,
        **config,
    )
    model = transformers.BertForSequenceClassification(bert_config).eval()
    model.save_pretrained(path, safe_serialization=True)
    source = EMBEDDED_ENCODERS[EMBEDDING_MODEL]()
    for name in TOKENIZER_FILES:
        shutil.copy(source / name, path / name)
    return path


def config_of(path: Path) -> dict[str, Any]:
    raw: dict[str, Any] = json.loads((path / "config.json").read_text())
    return raw
