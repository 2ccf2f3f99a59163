"""The registry tells decoder embedders and rerankers from chat models by their files alone
(models/retrieval/retrieval_files.py): a sentence-transformers folder pooling the last token, a
GGUF whose pooling_type is LAST, a Qwen3 folder whose name says reranker; what it cannot serve
is listed with the reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from tiny_gguf import write_gguf_from_hf
from tiny_models import SHAPE

from modelhost.residency.registry import ModelEntry, ModelRegistry


def decoder_folder(path: Path, model_type: str = "qwen3") -> Path:
    config_class, model_class = {
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    }[model_type]
    torch.manual_seed(0)
    model_class(config_class(vocab_size=256, tie_word_embeddings=True, **SHAPE)).save_pretrained(
        path
    )
    return path


def sentence_transformers_files(path: Path, pooling: str) -> Path:
    kinds = ("Transformer", "Pooling", "Normalize")
    paths = ("", "1_Pooling", "2_Normalize")
    modules = [
        {"idx": i, "name": str(i), "path": p, "type": f"sentence_transformers.models.{kind}"}
        for i, (kind, p) in enumerate(zip(kinds, paths, strict=True))
    ]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    pooling_config = {"word_embedding_dimension": 64, f"pooling_mode_{pooling}": True}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config))
    return path


def entry(root: Path, model_id: str, hub: Path | None = None) -> ModelEntry:
    registry = ModelRegistry(
        [root / "models"], home=root / "home", hf_hub=hub or root / "hub", embedded=False
    )
    found = registry.get(model_id)
    assert found is not None
    return found


def test_a_qwen3_sentence_transformers_folder_pooling_the_last_token_is_an_embedder(
    tmp_path: Path,
) -> None:
    sentence_transformers_files(decoder_folder(tmp_path / "models" / "emb"), "lasttoken")
    found = entry(tmp_path, "emb")
    assert found.operations == ("embed",) and found.refusal is None
    # its weights and one forward's working memory; no KV cache kept or claimed
    assert found.estimate_bytes > found.weights_bytes > 0
    assert found.kv_row_bytes == found.kv_pool_bytes == found.work_bytes == 0


def test_a_decoder_embedder_pooling_the_mean_is_listed_with_why_it_is_not_served(
    tmp_path: Path,
) -> None:
    sentence_transformers_files(decoder_folder(tmp_path / "models" / "emb"), "mean_tokens")
    found = entry(tmp_path, "emb")
    assert found.operations == ("embed",)
    assert "last-token pooling; this one pools by mean" in (found.refusal or "")


def test_a_qwen3_folder_whose_name_says_reranker_is_a_reranker(tmp_path: Path) -> None:
    decoder_folder(tmp_path / "models" / "tiny-Qwen3-Reranker")
    decoder_folder(tmp_path / "models" / "tiny-qwen3-chat")
    assert entry(tmp_path, "tiny-Qwen3-Reranker").operations == ("rerank",)
    assert entry(tmp_path, "tiny-qwen3-chat").operations == ("generate",)


def test_a_reranker_in_the_hub_cache_is_known_by_its_repository_name(tmp_path: Path) -> None:
    repo = tmp_path / "hub" / "models--Qwen--Qwen3-Reranker-0.6B"
    decoder_folder(repo / "snapshots" / "0123abcd")
    found = entry(tmp_path, "Qwen/Qwen3-Reranker-0.6B")
    assert found.operations == ("rerank",) and found.refusal is None


def test_a_llama_folder_whose_name_says_reranker_is_listed_with_why_it_is_not_served(
    tmp_path: Path,
) -> None:
    decoder_folder(tmp_path / "models" / "llama-reranker", "llama")
    found = entry(tmp_path, "llama-reranker")
    assert found.operations == ("rerank",)
    assert "served in Qwen3-Reranker's format" in (found.refusal or "")


@pytest.mark.parametrize(
    ("pooling", "operations", "refusal"),
    [
        (None, ("generate",), None),
        (3, ("embed",), None),
        (1, ("embed",), "last-token pooling, not mean"),
        (4, ("rerank",), "its rank pooling has no cls.output.weight head"),
    ],
)
def test_a_decoder_gguf_does_what_its_pooling_type_says(
    tmp_path: Path, pooling: int | None, operations: tuple[str, ...], refusal: str | None
) -> None:
    folder = decoder_folder(tmp_path / "folder")
    (tmp_path / "models").mkdir()
    write_gguf_from_hf(folder, tmp_path / "models" / "tiny.gguf", pooling_type=pooling)
    found = entry(tmp_path, "tiny")
    assert found.operations == operations
    assert (found.refusal is None) if refusal is None else refusal in (found.refusal or "")


def test_a_qwen3_gguf_with_llama_cpps_rank_head_is_a_reranker(tmp_path: Path) -> None:
    folder = decoder_folder(tmp_path / "folder")
    (tmp_path / "models").mkdir()
    write_gguf_from_hf(folder, tmp_path / "models" / "tiny.gguf", rank_head=(1, 2))
    found = entry(tmp_path, "tiny")
    assert found.operations == ("rerank",) and found.refusal is None


def test_a_decoder_converted_to_a_sequence_classifier_is_listed_with_why_it_is_not_served(
    tmp_path: Path,
) -> None:
    folder = decoder_folder(tmp_path / "models" / "seq-cls")
    raw = json.loads((folder / "config.json").read_text())
    raw["architectures"] = ["Qwen3ForSequenceClassification"]
    (folder / "config.json").write_text(json.dumps(raw))
    found = entry(tmp_path, "seq-cls")
    assert found.operations == ("rerank",)
    assert "sequence classifier is not served" in (found.refusal or "")
