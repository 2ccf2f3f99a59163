"""GGUF: hyper-parameters from metadata, tensors dequantized with the `gguf` package."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf.quants import dequantize

from modelhost.models.config import ModelConfig

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Llama places its MLP norm after attention; Gemma 3 has four norms per block.
_NORM_NAMES = {
    "llama": {"ffn_norm": "post_attention_layernorm"},
    "gemma3": {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


class GGUFFile:
    """An open GGUF file: metadata fields and tensors."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.reader = gguf.GGUFReader(str(path))
        self.architecture: str = self.field("general.architecture")

    def field(self, key: str, default: Any = None) -> Any:
        f = self.reader.fields.get(key)
        if f is None:
            return default
        return f.contents()

    def arch_field(self, key: str, default: Any = None) -> Any:
        return self.field(f"{self.architecture}.{key}", default)

    def config(self) -> ModelConfig:
        arch = self.architecture
        hidden = int(self.arch_field("embedding_length"))
        num_heads = int(self.arch_field("attention.head_count"))
        head_dim = int(self.arch_field("attention.key_length", hidden // num_heads))
        tensor_names = {t.name for t in self.reader.tensors}
        vocab = self.arch_field("vocab_size") or len(self.field("tokenizer.ggml.tokens"))
        common: dict[str, Any] = dict(
            architecture="gemma3" if arch == "gemma3" else "llama",
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(self.arch_field("feed_forward_length")),
            num_layers=int(self.arch_field("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(self.arch_field("attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            rms_norm_eps=float(self.arch_field("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(self.arch_field("rope.freq_base", 10_000.0)),
            context_length=int(self.arch_field("context_length", 4096)),
            tie_word_embeddings="output.weight" not in tensor_names,
            rope_scaling_factor=float(self.arch_field("rope.scaling.factor", 1.0) or 1.0),
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        )
        if arch == "gemma3":
            common.update(
                sliding_window=int(self.arch_field("attention.sliding_window", 512)),
                query_pre_attn_scalar=float(head_dim),
                final_logit_softcapping=self.arch_field("final_logit_softcapping"),
                attn_logit_softcapping=self.arch_field("attn_logit_softcapping"),
            )
        return ModelConfig(**common)

    def state_dict(self, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
        """Dequantized fp32 tensors under our (Hugging Face) parameter names."""
        family = "gemma3" if self.architecture == "gemma3" else "llama"
        norm_names = _NORM_NAMES[family]
        for tensor in self.reader.tensors:
            name = _hf_name(tensor.name, norm_names)
            if name is None:
                continue
            array = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
            if not (array.flags.writeable and array.flags.c_contiguous):  # F32 tensors are mmaps
                array = np.array(array, order="C")
            value = torch.from_numpy(array)
            if self.architecture == "llama":
                # llama.cpp's converter interleaves q/k rows for its rope; undo it for ours.
                if name.endswith("q_proj.weight"):
                    value = _unpermute(value, config.num_heads)
                elif name.endswith("k_proj.weight"):
                    value = _unpermute(value, config.num_kv_heads)
            yield name, value


def _hf_name(gguf_name: str, norm_names: dict[str, str]) -> str | None:
    match = _BLOCK.match(gguf_name)
    if match:
        layer, part, kind = match.groups()
        mapped = _LAYER_NAMES.get(part) or norm_names.get(part)
        return None if mapped is None else f"model.layers.{layer}.{mapped}.{kind}"
    stem, _, kind = gguf_name.rpartition(".")
    mapped = _GLOBAL_NAMES.get(stem)
    return None if mapped is None else f"{mapped}.{kind}"


def _unpermute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
        .transpose(1, 2)
        .reshape(weight.shape)
    )
