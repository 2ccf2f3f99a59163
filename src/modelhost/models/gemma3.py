"""Gemma 3 text: sandwich norms, q/k norms, GELU MLP, interleaved sliding-window layers."""

from __future__ import annotations

import math

import torch

from modelhost.models.batch import ForwardBatch, KVCache
from modelhost.models.config import ModelConfig
from modelhost.models.decoder import DecoderBlock, DecoderLM
from modelhost.models.layers import Attention, GatedMLP, RMSNorm, gelu_tanh


class Gemma3Block(DecoderBlock):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        scalar = config.query_pre_attn_scalar or config.head_dim
        self.self_attn = Attention(
            layer=layer,
            hidden=config.hidden_size,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            bias=False,
            qk_norm_eps=config.rms_norm_eps,
            scale=scalar**-0.5,
            window=config.sliding_window if config.is_sliding_layer(layer) else None,
        )
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, gelu_tanh)
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        kv: KVCache,
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), rope, batch, kv)
        x = x + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(mlp)

    def native_norms(self) -> tuple[RMSNorm | None, ...]:
        return (
            self.input_layernorm,
            self.post_attention_layernorm,
            self.pre_feedforward_layernorm,
            self.post_feedforward_layernorm,
        )


def build_gemma3(config: ModelConfig) -> DecoderLM:
    layers = [Gemma3Block(config, i) for i in range(config.num_layers)]
    return DecoderLM(config, layers, embed_scale=math.sqrt(config.hidden_size))
