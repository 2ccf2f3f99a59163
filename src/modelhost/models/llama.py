"""The Llama family (llama, mistral, qwen2, qwen3): pre-norm blocks, SwiGLU, rotary GQA."""

from __future__ import annotations

import torch

from modelhost.models.batch import ForwardBatch, KVCache
from modelhost.models.config import ModelConfig
from modelhost.models.decoder import DecoderBlock, DecoderLM
from modelhost.models.layers import Attention, RMSNorm
from modelhost.models.moe import sparse_or_dense_mlp


class LlamaBlock(DecoderBlock):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(
            layer=layer,
            hidden=config.hidden_size,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            bias=config.attention_bias,
            qk_norm_eps=config.rms_norm_eps if config.qk_norm else None,
        )
        self.mlp = sparse_or_dense_mlp(config, layer)  # Qwen3-MoE's layers: experts
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        kv: KVCache,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, batch, kv)
        return x + self.mlp(self.post_attention_layernorm(x))

    def native_norms(self) -> tuple[RMSNorm | None, ...]:
        return self.input_layernorm, None, self.post_attention_layernorm, None


def build_llama(config: ModelConfig) -> DecoderLM:
    return DecoderLM(config, [LlamaBlock(config, i) for i in range(config.num_layers)])
