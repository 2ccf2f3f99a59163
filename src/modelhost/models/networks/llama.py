"""The Llama-shaped block (Llama 2/3, Mistral, Qwen 2/3, Phi-3, SmolLM3, Granite): pre-norm,
SwiGLU, rotary grouped-query attention; the variants differ only in configuration."""

from __future__ import annotations

import torch

from modelhost.models.batch import ForwardBatch, KVCache
from modelhost.models.config import ModelConfig
from modelhost.models.networks.decoder import DecoderBlock, DecoderLM, attention_for
from modelhost.models.networks.layers import RMSNorm
from modelhost.models.networks.moe import sparse_or_dense_mlp


class LlamaBlock(DecoderBlock):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = attention_for(config, layer)
        self.mlp = sparse_or_dense_mlp(config, layer)  # Qwen3-MoE's layers: experts
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.residual_multiplier = config.residual_multiplier  # Granite's; 1 elsewhere

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        kv: KVCache,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        scale = self.residual_multiplier
        attn = self.self_attn(self.input_layernorm(x), rope, batch, kv, keep)
        x = (x if keep is None else x[keep]) + (attn if scale == 1.0 else attn * scale)
        mlp = self.mlp(self.post_attention_layernorm(x))
        return x + (mlp if scale == 1.0 else mlp * scale)

    def native_norms(self) -> tuple[RMSNorm | None, ...]:
        return self.input_layernorm, None, self.post_attention_layernorm, None


def build_llama(config: ModelConfig) -> DecoderLM:
    return DecoderLM(config, [LlamaBlock(config, i) for i in range(config.num_layers)])
