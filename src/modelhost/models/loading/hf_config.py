"""A Hugging Face directory's config.json as a ModelConfig, read without PyTorch (the registry
reads every directory's config this way)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from modelhost.models.config import ModelConfig


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


# Model types whose q, k and v projections carry biases though their configs do not say so.
QKV_BIAS = ("qwen2", "qwen2_vl", "qwen2_5_vl")


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
    if "text_config" in raw:  # multimodal wrappers keep the language model's config inside
        text = raw["text_config"]
        tied = [bool(r["tie_word_embeddings"]) for r in (raw, text) if "tie_word_embeddings" in r]
        # The wrapper's flag or the text config's (older saves put it there): either ties.
        raw = {**text, "model_type": text.get("model_type", "")}
        if tied:
            raw["tie_word_embeddings"] = any(tied)
    model_type = str(raw.get("model_type", "llama"))
    gemma = model_type.startswith(("gemma2", "gemma3"))
    hidden = int(raw["hidden_size"])
    num_heads = int(raw["num_attention_heads"])
    head_dim = int(raw.get("head_dim") or hidden // num_heads)
    rope = _rope_parameters(raw)
    local_rope = rope.pop("sliding_attention", None)
    fields: dict[str, Any] = dict(
        architecture="gemma" if gemma else "llama",
        model_type=model_type.removesuffix("_text"),
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta") or 10_000.0),
        context_length=int(raw.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", gemma)),
        attention_bias=bool(
            raw.get("attention_bias", model_type.removesuffix("_text") in QKV_BIAS)
        ),
        qk_norm=model_type.startswith("gemma3") or model_type.startswith("qwen3"),
        **_rope_fields(rope, raw, head_dim),
    )
    if rope.get("mrope_section"):
        fields["mrope_section"] = tuple(int(size) for size in rope["mrope_section"])
    partial = rope.get("partial_rotary_factor") or raw.get("partial_rotary_factor")
    if partial is not None and float(partial) < 1.0:
        fields["rope_dim"] = int(head_dim * float(partial))
    flags = raw.get("no_rope_layers")  # SmolLM3: 1 where a layer uses rotary, 0 where not
    if flags:
        fields["no_rope_layers"] = tuple(i for i, uses in enumerate(flags) if not uses)
    window = raw.get("sliding_window")
    if raw.get("use_sliding_window") is False:  # Qwen 2 lists a window it does not use
        window = None
    if window:
        fields["sliding_window"] = int(window)
        layer_types = raw.get("layer_types")
        if layer_types:
            kinds = ("sliding" if kind == "sliding_attention" else "global" for kind in layer_types)
            fields["layer_kinds"] = tuple(kinds)
        elif not gemma:  # Mistral, Phi-3: every layer
            fields["layer_kinds"] = ("sliding",) * fields["num_layers"]
        if model_type == "gemma2" and not layer_types:
            fields["sliding_window_pattern"] = 2
    if gemma:
        if model_type.startswith("gemma3"):
            theta = (local_rope or {}).get("rope_theta") or raw.get("rope_local_base_freq")
            fields.update(
                rope_local_theta=float(theta or 10_000.0),
                sliding_window=int(window or 512),
                sliding_window_pattern=int(raw.get("sliding_window_pattern") or 6),
            )
        fields.update(
            query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar") or head_dim),
            final_logit_softcapping=raw.get("final_logit_softcapping"),
            attn_logit_softcapping=raw.get("attn_logit_softcapping"),
        )
    for name in ("embedding_multiplier", "residual_multiplier", "logits_scaling"):
        if raw.get(name) is not None:
            fields[name] = float(raw[name])
    if raw.get("attention_multiplier") is not None:
        fields["attention_multiplier"] = float(raw["attention_multiplier"])
    if _expert_count(raw) > 0:
        fields.update(_experts(raw))
    return ModelConfig(**fields)


def _rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    """The rotary settings in one dict, whichever way the config spells them: transformers 5
    writes `rope_parameters` (Gemma 3: one per attention kind), older files `rope_theta` and
    `rope_scaling` (whose `type` is now `rope_type`)."""
    rope = dict(raw.get("rope_parameters") or {})
    if isinstance(rope.get("full_attention"), dict):
        rope = {**rope["full_attention"], "sliding_attention": rope.get("sliding_attention")}
    rope = {**rope, **(raw.get("rope_scaling") or {})}  # older files say it only there
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope["type"]
    if raw.get("rope_theta") is not None:
        rope.setdefault("rope_theta", raw["rope_theta"])
    if raw.get("original_max_position_embeddings") is not None:
        rope.setdefault("original_max_position_embeddings", raw["original_max_position_embeddings"])
    return rope


class UnsupportedRope(ValueError):
    """A rotary scaling this server does not compute (it would answer wrongly)."""


def _rope_fields(rope: dict[str, Any], raw: dict[str, Any], head_dim: int) -> dict[str, Any]:
    kind = str(rope.get("rope_type") or "default")
    if kind in ("default", "mrope"):  # M-RoPE's frequencies are the default ones
        return {}
    if kind == "linear":
        return {"rope_scaling_factor": float(rope.get("factor") or 1.0)}
    if kind == "llama3":
        theta = float(rope.get("rope_theta") or 10_000.0)
        return {"rope_freq_factors": llama3_freq_factors(rope, theta, head_dim)}
    if kind in ("longrope", "su"):
        original = int(rope.get("original_max_position_embeddings") or 4096)
        factor = float(raw.get("max_position_embeddings", original)) / original
        attention = rope.get("attention_factor")
        if attention is None:
            attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1
        return {
            "rope_freq_factors": tuple(float(f) for f in rope["short_factor"]),
            "rope_long_freq_factors": tuple(float(f) for f in rope["long_factor"]),
            "rope_original_context": original,
            "rope_attention_factor": float(attention),
        }
    raise UnsupportedRope(f"rotary scaling '{kind}' is not supported")


def llama3_freq_factors(rope: dict[str, Any], theta: float, dim: int) -> tuple[float, ...]:
    """Llama 3.1's rotary scaling as a divisor of each frequency (what a GGUF's rope_freqs
    tensor holds): the low frequencies slowed by `factor`, the high ones kept, a smooth blend
    between."""
    factor = float(rope.get("factor", 8.0))
    low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    original = float(rope.get("original_max_position_embeddings", 8192))
    divisors = []
    for i in range(0, dim, 2):
        wavelength = 2 * math.pi * theta ** (i / dim)
        if wavelength < original / high:
            divisors.append(1.0)
        elif wavelength > original / low:
            divisors.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return tuple(divisors)


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
