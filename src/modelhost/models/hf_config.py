"""A Hugging Face directory's config.json as a ModelConfig, read without PyTorch (the registry
reads every directory's config this way)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from modelhost.models.config import ModelConfig


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
    if "text_config" in raw:  # multimodal wrappers keep the language model's config inside
        raw = {**raw["text_config"], "model_type": raw["text_config"].get("model_type", "")}
    model_type = str(raw.get("model_type", "llama"))
    gemma = model_type.startswith("gemma3")
    hidden = int(raw["hidden_size"])
    num_heads = int(raw["num_attention_heads"])
    head_dim = int(raw.get("head_dim") or hidden // num_heads)
    rope = raw.get("rope_parameters") or {}
    if gemma and isinstance(rope.get("full_attention"), dict):
        local = rope.get("sliding_attention") or {}
        rope, local_theta = rope["full_attention"], local.get("rope_theta")
    else:
        local_theta = None
    scaling = raw.get("rope_scaling") or rope
    factor = scaling.get("factor") if scaling.get("rope_type", "linear") == "linear" else None
    fields: dict[str, Any] = dict(
        architecture="gemma3" if gemma else "llama",
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(raw.get("rope_theta") or rope.get("rope_theta") or 10_000.0),
        context_length=int(raw.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", gemma)),
        rope_scaling_factor=float(factor or 1.0),
        attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
        qk_norm=gemma or model_type in ("qwen3", "qwen3_moe"),
    )
    if gemma:
        layer_types = raw.get("layer_types")
        if layer_types:
            kinds = ("sliding" if kind == "sliding_attention" else "global" for kind in layer_types)
            fields["layer_kinds"] = tuple(kinds)
        fields.update(
            rope_local_theta=float(local_theta or raw.get("rope_local_base_freq", 10_000.0)),
            sliding_window=int(raw.get("sliding_window") or 512),
            sliding_window_pattern=int(raw.get("sliding_window_pattern") or 6),
            query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar") or head_dim),
            final_logit_softcapping=raw.get("final_logit_softcapping"),
            attn_logit_softcapping=raw.get("attn_logit_softcapping"),
        )
    if _expert_count(raw) > 0:
        fields.update(_experts(raw))
    return ModelConfig(**fields)


def _expert_count(raw: dict[str, Any]) -> int:
    # Qwen's own configs say `num_experts`; transformers 5 writes `num_local_experts`.
    return int(raw.get("num_experts") or raw.get("num_local_experts") or 0)


def _experts(raw: dict[str, Any]) -> dict[str, Any]:
    """A mixture-of-experts config's fields (Qwen3-MoE's names)."""
    return dict(
        num_experts=_expert_count(raw),
        num_experts_per_tok=int(raw["num_experts_per_tok"]),
        moe_intermediate_size=int(raw["moe_intermediate_size"]),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        decoder_sparse_step=int(raw.get("decoder_sparse_step") or 1),
        mlp_only_layers=tuple(int(layer) for layer in raw.get("mlp_only_layers") or ()),
    )
