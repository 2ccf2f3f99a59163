"""Gemma 2 and Gemma 3 text: sandwich norms, GELU MLP, interleaved sliding-window layers;
Gemma 2 soft-caps its attention scores, Gemma 3 normalises q and k instead."""

from __future__ import annotations

import math

import torch

from modelhost.models.batch import ForwardBatch, KVCache
from modelhost.models.config import ModelConfig
from modelhost.models.networks.decoder import DecoderBlock, DecoderLM, attention_for
from modelhost.models.networks.layers import GatedMLP, RMSNorm, gelu_tanh


class GemmaBlock(DecoderBlock):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = attention_for(config, layer)
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
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), rope, batch, kv, keep)
        x = (x if keep is None else x[keep]) + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(mlp)

    def native_norms(self) -> tuple[RMSNorm | None, ...]:
        return (
            self.input_layernorm,
            self.post_attention_layernorm,
            self.pre_feedforward_layernorm,
            self.post_feedforward_layernorm,
        )


def build_gemma(config: ModelConfig) -> DecoderLM:
    layers = [GemmaBlock(config, i) for i in range(config.num_layers)]
    return DecoderLM(config, layers, embed_scale=math.sqrt(config.hidden_size))
