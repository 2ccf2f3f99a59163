"""The 8-bit KV cache's slots (`--kv-cache q8`): each head's key or value as int8 in groups of
GROUP values, each group with a bf16 scale (its absolute maximum / 127), as llama.cpp's q8_0
but for the scale's type; the scales sit in the same slot after the values, so a pool stays one
tensor per layer and a block stays a run of slots (the prefix store copies blocks as bytes).

A slot is [2, kv_heads, kv_q8_layout.slot_width(head_dim)] int8. Groups rather than one scale a
head: Gemma 3's normed keys carry a few large channels, and one fp32 scale over its 256 put the
rest on a coarse grid (perplexity +2.6%; +0.3% in groups of 32). bf16 rather than fp16 scales:
SmolLM2's small values took fp16's subnormal scales (+0.7% against +0.4%). The values are
rounded against the scale as stored, so the scale's own rounding costs nothing but a clamp.
The native kernels (models/kernels/native_kv_q8.h) write these same bytes and read the pool in
place for decode steps and prompts of short context; longer prompts go through the PyTorch path
below, each layer's gathered blocks turned back to fp32 before SDPA (the tiled prompt kernel
reads fp16 and fp32 pools only).
"""

from __future__ import annotations

import torch

from modelhost.models.kv_q8_layout import groups

_LEVELS = 127.0


def is_q8(pool: torch.Tensor) -> bool:
    return pool.dtype == torch.int8


def quantize(kv: torch.Tensor) -> torch.Tensor:
    """kv [..., head_dim] (float) as q8 slots [..., slot_width(head_dim)] int8."""
    head_dim = kv.shape[-1]
    grouped = kv.float().unflatten(-1, (groups(head_dim), -1))
    scale = grouped.abs().amax(dim=-1, keepdim=True).div_(_LEVELS).to(torch.bfloat16)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale)).float()
    ints = torch.round(grouped / safe).clamp_(-_LEVELS, _LEVELS).to(torch.int8)
    scale_columns = scale.squeeze(-1).contiguous().view(torch.int8)  # [..., 2 * groups]
    return torch.cat((ints.flatten(-2), scale_columns), dim=-1)


def dequantize(slots: torch.Tensor, head_dim: int) -> torch.Tensor:
    """q8 slots [..., slot_width(head_dim)] int8 as fp32 [..., head_dim]. Slots never written
    read as zeros (scale 0), which attention masks anyway."""
    scale = slots[..., head_dim:].contiguous().view(torch.bfloat16).float().unsqueeze(-1)
    values = slots[..., :head_dim].unflatten(-1, (groups(head_dim), -1)).float()
    return (values * scale).flatten(-2)
