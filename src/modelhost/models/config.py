"""Architecture hyper-parameters, read from config.json or GGUF metadata into one record."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ModelConfig:
    # The block's shape: "llama" (pre-norm, SwiGLU: Llama, Mistral, Qwen, Phi-3, SmolLM3,
    # Granite) or "gemma" (four norms a block, (1 + w) norms, GELU, scaled embeddings).
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    context_length: int
    tie_word_embeddings: bool = True
    model_type: str = "llama"  # the family (models/families.py names), for the converter
    rope_scaling_factor: float = 1.0  # linear scaling of global-layer positions
    # Per rotary frequency, a divisor of it: Llama 3's smoothed low-frequency scaling (GGUF's
    # rope_freqs) or Phi-3's longrope short factors. None: all 1.
    rope_freq_factors: tuple[float, ...] | None = None
    rope_attention_factor: float = 1.0  # longrope's scale of cos and sin
    # Longrope's long factors, for a sequence once it is longer than the original context.
    rope_long_freq_factors: tuple[float, ...] | None = None
    rope_original_context: int | None = None
    rope_dim: int | None = None  # rotated dimensions of a head (partial rotary); None: all
    # M-RoPE (Qwen2-VL, Qwen2.5-VL): rotary frequency pairs per position axis (temporal,
    # height, width), summing to half a head; None: one position per token.
    mrope_section: tuple[int, ...] | None = None
    no_rope_layers: tuple[int, ...] = ()  # layers that attend without rotary (SmolLM3)
    attention_bias: bool = False  # qwen2 has biases on q/k/v
    qk_norm: bool = False  # qwen3 and gemma3 normalise q and k per head
    # Sliding-window attention: Gemma 2/3 on alternate layers (layer_kinds or the pattern),
    # Mistral and Phi-3 on every layer.
    rope_local_theta: float | None = None  # sliding layers' rotary base (None: rope_theta)
    sliding_window: int | None = None
    sliding_window_pattern: int = 6  # every Nth layer is global, unless `layer_kinds` says
    layer_kinds: tuple[str, ...] | None = None  # per layer: "sliding" or "global"
    query_pre_attn_scalar: float | None = None  # attention scale 1/sqrt(this) (Gemma)
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    # Granite's multipliers (1.0 elsewhere); Gemma's sqrt(hidden) embedding scale is the same idea.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None  # the attention scale itself, where given
    logits_scaling: float = 1.0  # logits are divided by it
    # Mixture of experts (Qwen3-MoE, models/networks/moe.py): 0 experts means every MLP is dense
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the chosen experts' weights to sum to 1
    decoder_sparse_step: int = 1  # every Nth layer is sparse ...
    mlp_only_layers: tuple[int, ...] = ()  # ... except these, which keep a dense MLP

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether this layer's MLP is a mixture of experts."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_json(cls, fields: dict[str, Any]) -> ModelConfig:
        """The record as `dataclasses.asdict` gave it and JSON kept it (tuples as lists)."""
        values: dict[str, Any] = {
            key: tuple(value) if isinstance(value, list) else value for key, value in fields.items()
        }
        return cls(**values)

    def is_sliding_layer(self, layer: int) -> bool:
        if self.sliding_window is None:
            return False
        if self.layer_kinds is not None:
            return self.layer_kinds[layer] == "sliding"
        return (layer + 1) % self.sliding_window_pattern != 0

    def rope_kind(self, layer: int) -> str:
        """Which rotary a layer uses: "global", "local" (a sliding layer with its own base)
        or "none"."""
        if layer in self.no_rope_layers:
            return "none"
        if self.is_sliding_layer(layer) and self.rope_local_theta is not None:
            return "local"
        return "global"

    def attention_scale(self) -> float:
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV cache bytes one token costs across all layers (keys and values)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes
