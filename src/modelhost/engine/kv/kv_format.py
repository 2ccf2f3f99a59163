"""How the KV pool holds keys and values (`--kv-cache`), and what a token costs in it: kept apart
from the engine so the registry and admission can count it without importing PyTorch.

- `f16`: the model's cache dtype (fp16 on CPUs, bf16 on CUDA, fp32 in the `none` mode).
- `q8`: int8 values in groups of 32 with a bf16 scale each (absmax / 127, llama.cpp's
  q8_0 with a bf16 scale), per token, head, and key or value, stored in the same slot as the values
  (models/kv_q8.py): a token costs D + D / 16 bytes a head where fp16 costs 2 D (53%). Per
  token, not per block: a block fills one token at a time, and a scale fixed by its first
  token would clip the rest.
"""

from __future__ import annotations

from typing import Literal

from modelhost.models.config import ModelConfig
from modelhost.models.kv_q8_layout import slot_width

KVFormat = Literal["f16", "q8"]
KV_FORMATS: tuple[KVFormat, ...] = ("f16", "q8")


def kv_token_bytes(config: ModelConfig, dtype_bytes: int, kv_format: str = "f16") -> int:
    """KV bytes one token costs across all layers: keys and values at `dtype_bytes` (f16), or
    int8 with their scales (q8)."""
    if kv_format == "q8":
        return 2 * config.num_layers * config.num_kv_heads * slot_width(config.head_dim)
    return config.kv_bytes_per_token(dtype_bytes)


def parse_kv_format(value: str) -> KVFormat:
    if value not in KV_FORMATS:
        raise ValueError(f"--kv-cache takes one of {', '.join(KV_FORMATS)}, not '{value}'")
    return value
