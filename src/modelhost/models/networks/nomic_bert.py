"""NomicBERT sentence encoders (nomic-embed-text v1 / v1.5), as transformers' NomicBertModel
computes them: word + token-type embeddings and a LayerNorm (no position rows), then post-norm
layers whose attention rotates queries and keys (rotary, halves not interleaved, base
`rope_theta`, 1000 for nomic-embed) and whose MLP is SwiGLU (`down(silu(gate(x)) * up(x))`),
no biases on any projection.

A folder comes in either spelling: transformers' own (`layers.N.self_attn.q_proj`, `hidden_size`
…) or nomic's original remote-code one (`encoder.layers.N.attn.Wqkv` fused, `mlp.fc11` up,
`mlp.fc12` gate, `norm1`/`norm2`, `emb_ln`; `n_embd`, `n_layer` …), which transformers renames
the same way when it loads one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from modelhost.models.networks.bert import (
    EmbeddingModel,
    EncoderTokenizer,
    load_state,
    renamed,
)
from modelhost.models.networks.encoder_files import nomic_refusal, read_pooling


def _first(raw: dict[str, Any], *keys: str, default: Any = None) -> Any:
    return next((raw[k] for k in keys if raw.get(k) is not None), default)


@dataclass(frozen=True, slots=True)
class NomicConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    type_vocab_size: int
    layer_norm_eps: float
    rope_theta: float
    max_seq_length: int

    @classmethod
    def from_dir(cls, path: Path) -> NomicConfig:
        raw = json.loads((path / "config.json").read_text())
        refusal = nomic_refusal(raw)
        if refusal is not None:
            raise ValueError(f"{path}: {refusal}")
        rope = raw.get("rope_parameters") or {}
        max_seq = int(_first(raw, "max_trained_positions", "max_position_embeddings", default=2048))
        sentence = path / "sentence_bert_config.json"
        if sentence.is_file():
            max_seq = json.loads(sentence.read_text()).get("max_seq_length", max_seq)
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=_first(raw, "hidden_size", "n_embd", default=768),
            num_layers=_first(raw, "num_hidden_layers", "n_layer", default=12),
            num_heads=_first(raw, "num_attention_heads", "n_head", default=12),
            intermediate_size=_first(raw, "intermediate_size", "n_inner", default=3072),
            type_vocab_size=raw.get("type_vocab_size", 2),
            layer_norm_eps=_first(raw, "layer_norm_eps", "layer_norm_epsilon", default=1e-12),
            rope_theta=float(_first(rope, "rope_theta", default=raw.get("rotary_emb_base", 1000))),
            max_seq_length=int(max_seq),
        )


class NomicLayer(nn.Module):
    def __init__(self, config: NomicConfig) -> None:
        super().__init__()
        hidden, inner, eps = config.hidden_size, config.intermediate_size, config.layer_norm_eps
        self.num_heads = config.num_heads
        self.query = nn.Linear(hidden, hidden, bias=False)
        self.key = nn.Linear(hidden, hidden, bias=False)
        self.value = nn.Linear(hidden, hidden, bias=False)
        self.attn_out = nn.Linear(hidden, hidden, bias=False)
        self.attn_norm = nn.LayerNorm(hidden, eps=eps)
        self.gate = nn.Linear(hidden, inner, bias=False)
        self.up = nn.Linear(hidden, inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)
        self.out_norm = nn.LayerNorm(hidden, eps=eps)

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        batch, length, hidden = x.shape

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, length, self.num_heads, -1).transpose(1, 2)

        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = self.attn_norm(x + self.attn_out(attn.transpose(1, 2).reshape(batch, length, hidden)))
        return self.out_norm(x + self.down(F.silu(self.gate(x)) * self.up(x)))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class NomicEncoder(nn.Module):
    def __init__(self, config: NomicConfig) -> None:
        super().__init__()
        self.config = config
        self.word = nn.Embedding(config.vocab_size, config.hidden_size)
        self.token_type = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.layers = nn.ModuleList(NomicLayer(config) for _ in range(config.num_layers))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Last hidden states [B, L, H] for right-padded ids (one segment: token type 0)."""
        x = self.norm(self.word(input_ids) + self.token_type.weight[0])
        head_dim = self.config.hidden_size // self.config.num_heads
        steps = torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim
        inv_freq = 1.0 / (self.config.rope_theta**steps)
        angles = torch.arange(input_ids.shape[1], dtype=torch.float)[:, None] * inv_freq
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        mask = attention_mask.bool()[:, None, None, :]
        for layer in self.layers:
            x = layer(x, mask, cos, sin)
        return x


_LAYER_NAMES = {
    "self_attn.q_proj": "query",
    "self_attn.k_proj": "key",
    "self_attn.v_proj": "value",
    "self_attn.o_proj": "attn_out",
    "attn.out_proj": "attn_out",
    "post_attention_layernorm": "attn_norm",
    "norm1": "attn_norm",
    "mlp.gate_proj": "gate",
    "mlp.fc12": "gate",
    "mlp.up_proj": "up",
    "mlp.fc11": "up",
    "mlp.down_proj": "down",
    "mlp.fc2": "down",
    "post_mlp_layernorm": "out_norm",
    "norm2": "out_norm",
}
_TOP_NAMES = {
    "embeddings.word_embeddings": "word",
    "embeddings.token_type_embeddings": "token_type",
    "embeddings.LayerNorm": "norm",
    "emb_ln": "norm",
}


def _tensor_name(name: str) -> str | None:
    name = name.removeprefix("nomic_bert.").removeprefix("encoder.")
    return renamed(name, _TOP_NAMES, "layers.", _LAYER_NAMES)


def unfused(
    tensors: dict[str, torch.Tensor],
    fused: str = "attn.Wqkv.weight",
    split: str = "self_attn.{}_proj.weight",
) -> dict[str, torch.Tensor]:
    """A fused query-key-value tensor (nomic's `attn.Wqkv`, a GGUF's `attn_qkv`) split into
    the three projections, named `split` with q, k, v."""
    out = {}
    for name, tensor in tensors.items():
        if name.endswith(fused):
            stem = name.removesuffix(fused)
            for part, chunk in zip("qkv", tensor.chunk(3, dim=0), strict=True):
                out[stem + split.format(part)] = chunk
        else:
            out[name] = tensor
    return out


def load_nomic_bert(path: Path, model_id: str | None = None) -> EmbeddingModel:
    """A NomicBERT sentence encoder from its folder (either spelling, module docstring)."""
    config = NomicConfig.from_dir(path)
    network = NomicEncoder(config)
    tensors = unfused(load_file(str(path / "model.safetensors")))
    load_state(network, tensors, _tensor_name, str(path))
    return EmbeddingModel(
        id=model_id or path.name,
        path=path,
        config=config,
        text=EncoderTokenizer.from_dir(path),
        network=network,
        pooling=read_pooling(path),
    )
