"""NomicBERT (nomic-embed-text's architecture: rotary, SwiGLU, no biases) against
sentence-transformers over transformers' own NomicBertModel, on tiny random models, with the
tensors and config keys in either spelling (nomic's original: fused Wqkv, fc11/fc12/fc2,
n_embd …; transformers' own)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file
from tiny_encoders import make_nomic_encoder

from modelhost.models.networks.nomic_bert import load_nomic_bert

TEXTS = ["search_query: what do pandas eat", "search_document: bamboo " * 30, "a"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_nomic_encoder(tmp_path_factory.mktemp("nomic"))


def reference(folder: Path) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    return torch.tensor(SentenceTransformer(str(folder), device="cpu").encode(TEXTS))


def test_embeddings_equal_sentence_transformers_over_transformers_nomic_bert(folder: Path) -> None:
    model = load_nomic_bert(folder)
    ours = model.embed([model.token_ids(text) for text in TEXTS])
    torch.testing.assert_close(ours, reference(folder), atol=1e-5, rtol=1e-4)


def test_transformers_tensor_names_and_nomics_config_keys_embed_the_same(
    folder: Path, tmp_path: Path
) -> None:
    # save_pretrained writes nomic's original tensor names (fused Wqkv, fc11 …) beside
    # transformers' config keys; here the other way round: transformers' own tensor names
    # (split q/k/v, gate/up/down) and the original config keys (n_embd, n_layer …).
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    native = transformers.NomicBertModel.from_pretrained(folder).state_dict()
    save_file({k: v.contiguous() for k, v in native.items()}, str(other / "model.safetensors"))
    raw = json.loads((folder / "config.json").read_text())
    nomic = {
        "model_type": "nomic_bert",
        "vocab_size": raw["vocab_size"],
        "n_embd": 32,
        "n_layer": 2,
        "n_head": 2,
        "n_inner": 48,
        "n_positions": 64,
        "rotary_emb_base": 1000,
        "layer_norm_epsilon": raw["layer_norm_eps"],
        "activation_function": "swiglu",
        "type_vocab_size": 2,
        "prenorm": False,
        "qkv_proj_bias": False,
    }
    (other / "config.json").write_text(json.dumps(nomic))
    model = load_nomic_bert(other)
    ours = model.embed([model.token_ids(text) for text in TEXTS])
    torch.testing.assert_close(ours, reference(folder), atol=1e-5, rtol=1e-4)
