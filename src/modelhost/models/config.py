"""Architecture hyper-parameters, read from config.json or GGUF metadata into one record."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str  # "llama" (llama, mistral, qwen2, qwen3 share the class) or "gemma3"
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
    rope_scaling_factor: float = 1.0  # linear scaling of global-layer positions
    attention_bias: bool = False  # qwen2 has biases on q/k/v
    qk_norm: bool = False  # qwen3 and gemma3 normalise q and k per head
    # Gemma 3 only
    rope_local_theta: float = 10_000.0
    sliding_window: int | None = None
    sliding_window_pattern: int = 6  # every Nth layer is global, unless `layer_kinds` says
    layer_kinds: tuple[str, ...] | None = None  # per layer: "sliding" or "global"
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    # Mixture of experts (Qwen3-MoE, models/moe.py): 0 experts means every MLP is dense
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

    def is_sliding_layer(self, layer: int) -> bool:
        if self.sliding_window is None:
            return False
        if self.layer_kinds is not None:
            return self.layer_kinds[layer] == "sliding"
        return (layer + 1) % self.sliding_window_pattern != 0

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV cache bytes one token costs across all layers (keys and values)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes
