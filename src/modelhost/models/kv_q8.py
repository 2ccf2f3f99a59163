"""The 8-bit KV cache's slots (`--kv-cache q8`): each head's key or value as int8 with one fp32
scale (its absolute maximum / 127) after it, in the same slot, so a pool stays one tensor per
layer and a block stays a run of slots (the prefix store copies blocks as bytes).

A slot is [2, kv_heads, head_dim + SCALE_BYTES] int8. Attention reads it through the PyTorch
path: each layer's gathered blocks are turned back to fp32 before SDPA (the native kernels read
fp16 and fp32 pools only), so a q8 pool costs a dequantizing pass a layer a step.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # one fp32 scale (engine/kv/kv_format.py counts it)
_LEVELS = 127.0


def slot_width(head_dim: int) -> int:
    """The int8 columns of one head's key or value in a q8 slot."""
    return head_dim + SCALE_BYTES


def is_q8(pool: torch.Tensor) -> bool:
    return pool.dtype == torch.int8


def quantize(kv: torch.Tensor) -> torch.Tensor:
    """kv [..., head_dim] (float) as q8 slots [..., head_dim + SCALE_BYTES] int8."""
    values = kv.float()
    scale = values.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30) / _LEVELS
    ints = torch.round(values / scale).clamp_(-_LEVELS, _LEVELS).to(torch.int8)
    scale_bytes = scale.contiguous().view(torch.int8)  # [..., 4]
    return torch.cat((ints, scale_bytes), dim=-1)


def dequantize(slots: torch.Tensor) -> torch.Tensor:
    """q8 slots [..., head_dim + SCALE_BYTES] int8 as fp32 [..., head_dim]. Slots never
    written read as zeros (scale 0), which attention masks anyway."""
    head_dim = slots.shape[-1] - SCALE_BYTES
    scale = slots[..., head_dim:].contiguous().view(torch.float32)  # [..., 1]
    return slots[..., :head_dim].float() * scale
