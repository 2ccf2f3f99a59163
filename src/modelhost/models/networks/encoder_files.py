"""What an encoder's files say, read without PyTorch (the registry lists and refuses from it
before anything loads): which encoders are served, and how a sentence encoder turns its hidden
states into one vector.

A sentence-transformers folder says it in `modules.json`: a Transformer, a Pooling module whose
`config.json` names the mode (`pooling_mode: "cls"` since v5, `pooling_mode_cls_token: true` and
its siblings before), and a Normalize module when the vectors are unit length. A folder without
`modules.json` is what sentence-transformers makes of a bare Hugging Face model: mean pooling,
not normalised. A GGUF file names its mode in `<arch>.pooling_type` (llama.cpp's enum); llama.cpp
normalises pooled embeddings by default, so a GGUF's vectors are unit length.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODES = ("cls", "mean", "max", "lasttoken")
# sentence-transformers' older Pooling config: one flag a mode.
_FLAGS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_lasttoken": "lasttoken",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
}
# Modules that change nothing we compute: the encoder itself and the normalisation flag.
_TRANSFORMER, _POOLING, _NORMALIZE = "Transformer", "Pooling", "Normalize"
# config.json's model_type of the encoders served (networks/bert.py).
ENCODER_TYPES = frozenset({"bert", "roberta", "xlm-roberta", "nomic_bert"})
# GGUF encoders (models/loading/encoder_gguf.py): llama.cpp's architecture names for BERT, RoBERTa
# and XLM-R, and for NomicBERT, and the vocabularies it writes for them (WordPiece; XLM-R's
# Unigram).
GGUF_ENCODER_ARCHITECTURES = frozenset({"bert", "nomic-bert"})
GGUF_ENCODER_TOKENIZERS = frozenset({"bert", "t5"})
# llama.cpp's enum llama_pooling_type, as `<arch>.pooling_type` stores it.
GGUF_POOLING = {0: "none", 1: "mean", 2: "cls", 3: "lasttoken", 4: "rank"}


@dataclass(frozen=True, slots=True)
class Pooling:
    mode: str  # one of MODES
    normalize: bool  # unit vectors out


class UnsupportedPooling(ValueError):
    """A sentence-transformers layout this server cannot reproduce exactly."""


def read_pooling(path: Path) -> Pooling:
    """The pooling and normalisation of the sentence encoder in folder `path`."""
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return Pooling("mean", normalize=False)
    modules = json.loads(modules_file.read_text())
    kinds = [str(m.get("type", "")).rpartition(".")[2] for m in modules]
    unknown = [k for k in kinds if k not in (_TRANSFORMER, _POOLING, _NORMALIZE)]
    if unknown:
        raise UnsupportedPooling(f"its sentence-transformers modules {unknown} are not supported")
    mode = "mean"  # a Transformer alone yields token vectors; sentence-transformers adds mean
    for module, kind in zip(modules, kinds, strict=True):
        if kind == _POOLING:
            config = json.loads((path / str(module.get("path", "")) / "config.json").read_text())
            mode = _pooling_mode(config)
    return Pooling(mode, normalize=_NORMALIZE in kinds)


def _pooling_mode(config: dict[str, object]) -> str:
    named = config.get("pooling_mode")
    if isinstance(named, str):
        modes = [named]
    else:
        modes = [mode for flag, mode in _FLAGS.items() if config.get(flag)]
    if len(modes) != 1 or modes[0] not in MODES:
        raise UnsupportedPooling(f"pooling {' + '.join(modes) or 'none'} is not supported")
    return modes[0]


def gguf_pooling(pooling_type: int | None, *, default: str) -> str:
    """A GGUF's pooling name ("rank" for a reranker) from its `pooling_type`; `default` when the
    file names none (llama.cpp then takes the architecture's own)."""
    if pooling_type is None:
        return default
    if pooling_type not in GGUF_POOLING or GGUF_POOLING[pooling_type] == "none":
        raise UnsupportedPooling(f"GGUF pooling_type {pooling_type} is not supported")
    return GGUF_POOLING[pooling_type]


def embedding_refusal(path: Path, raw: dict[str, Any]) -> str | None:
    """Why the sentence-encoder folder `path` (its config.json `raw`) cannot be served."""
    if raw.get("model_type") not in ENCODER_TYPES:
        return f"{raw.get('model_type')} encoders are not served (only {sorted(ENCODER_TYPES)})"
    if raw["model_type"] == "nomic_bert":
        refusal = nomic_refusal(raw)
        if refusal is not None:
            return refusal
    elif raw.get("hidden_act", "gelu") != "gelu":
        return f"its activation {raw.get('hidden_act')} is not supported (only gelu)"
    try:
        read_pooling(path)
    except UnsupportedPooling as exc:
        return str(exc)
    return None


def gguf_encoder_kind(
    pooling_type: int | None, tokenizer_model: object, tensor_names: set[str]
) -> tuple[str, str | None]:
    """What a GGUF encoder serves ("rerank" or "embed": a classifier head's `cls.output` or
    pooling_type rank make a reranker) and why it cannot be served (None: it can)."""
    operation = "rerank" if pooling_type == 4 or "cls.output.weight" in tensor_names else "embed"
    if tokenizer_model not in GGUF_ENCODER_TOKENIZERS:
        served = ", ".join(sorted(GGUF_ENCODER_TOKENIZERS))
        return operation, f"its {tokenizer_model} tokenizer is not supported (only {served})"
    try:
        gguf_pooling(pooling_type, default="mean")
    except UnsupportedPooling as exc:
        return operation, str(exc)
    return operation, None


def nomic_refusal(raw: dict[str, Any]) -> str | None:
    """Why a nomic_bert config.json describes a model networks/nomic_bert.py does not compute
    (transformers' keys or nomic's original ones)."""
    activation = raw.get("hidden_act") or raw.get("activation_function") or "silu"
    if activation not in ("silu", "swiglu"):
        return f"a NomicBERT with {activation} activations is not supported (only SwiGLU)"
    if raw.get("moe_every_n_layers") or raw.get("prenorm") or raw.get("qkv_proj_bias"):
        return "NomicBERT mixture-of-experts, pre-norm or biased variants are not supported"
    rope_type = (raw.get("rope_parameters") or {}).get("rope_type", "default")
    if rope_type != "default" or raw.get("rotary_emb_scale_base") is not None:
        return f"NomicBERT with {rope_type} rotary scaling is not supported"
    if raw.get("rotary_emb_fraction", 1.0) != 1.0 or raw.get("rotary_emb_interleaved"):
        return "NomicBERT with partial or interleaved rotary embeddings is not supported"
    return None
