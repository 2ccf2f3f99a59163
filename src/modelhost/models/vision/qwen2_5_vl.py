"""Qwen2.5-VL's vision side: a ViT over an image's patches at their own resolution (2-D rotary
positions, RMSNorm, SwiGLU MLP; attention inside windows of merge units except in the full
attention layers), then the patch merger (RMSNorm, each 2 x 2 block of patches side by side,
a GELU MLP into the text model's width). The preprocessing is models/vision/qwen2_5_vl_image.py;
the text side is the Qwen2 network with M-RoPE (models/vision/mrope.py).

Linears are built like the text model's (same kernels and quantization). Parameters are read
under neutral names (`layers.N.qkv`, `merger_fc1`, ...) that models/vision/qwen_checkpoints.py
maps Hugging Face's and llama.cpp's names onto.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from modelhost.models.loading.weights import TensorSource, WeightPlan, linear_from
from modelhost.models.networks.layers import apply_rotary_
from modelhost.models.vision.qwen2_5_vl_image import (
    IMAGE_TOKEN,
    QwenImageConfig,
    QwenPixels,
    mrope_offsets,
    patches,
    prompt_text,
)
from modelhost.models.vision.tower import ImagePlan

NORM_EPS = 1e-6  # the tower's RMSNorms (transformers hard-codes it)


@dataclass(frozen=True, slots=True)
class QwenVisionShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    patch: int
    merge: int
    window: int  # a window's edge in pixels
    full_attention: tuple[int, ...]  # layers attending over the whole image
    rope_theta: float = 10_000.0

    @property
    def window_units(self) -> int:
        """A window's edge in merge units."""
        return self.window // self.merge // self.patch


class _RMSNorm(nn.Module):
    def __init__(self, source: TensorSource, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(source.dense().to(device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.rms_norm(x.float(), (x.shape[-1],), None, NORM_EPS)
        return (self.weight * out.to(x.dtype)).to(x.dtype)


def _linear(sources: Mapping[str, TensorSource], stem: str, plan: WeightPlan) -> nn.Module:
    """A linear stored whole (`stem`) or, as llama.cpp splits q, k and v, in parts."""
    if f"{stem}.weight" in sources:
        return linear_from(sources, [stem], plan)
    prefix = stem.removesuffix("qkv")
    return linear_from(sources, [f"{prefix}q", f"{prefix}k", f"{prefix}v"], plan)


class _Block(nn.Module):
    def __init__(
        self,
        sources: Mapping[str, TensorSource],
        prefix: str,
        shape: QwenVisionShape,
        plan: WeightPlan,
    ) -> None:
        super().__init__()
        self.norm1 = _RMSNorm(sources[f"{prefix}norm1.weight"], plan.device)
        self.qkv = _linear(sources, f"{prefix}qkv", plan)
        self.proj = linear_from(sources, [f"{prefix}proj"], plan)
        self.norm2 = _RMSNorm(sources[f"{prefix}norm2.weight"], plan.device)
        self.gate_up = linear_from(sources, [f"{prefix}gate", f"{prefix}up"], plan)
        self.down = linear_from(sources, [f"{prefix}down"], plan)
        self.heads = shape.heads
        self.head_dim = shape.hidden // shape.heads
        self.intermediate = shape.intermediate

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        segments: list[torch.Tensor],
    ) -> torch.Tensor:
        """x: [patches, hidden]; `segments`: [k, length] index groups of patches attending
        among themselves (windows, or the whole image)."""
        tokens, hidden = x.shape
        qkv = self.qkv(self.norm1(x)).float().view(tokens, 3, self.heads, self.head_dim)
        q, k, v = (qkv[:, i].contiguous() for i in range(3))
        apply_rotary_(q, *rope)
        apply_rotary_(k, *rope)
        out = torch.empty_like(q)
        for index in segments:  # each [k, length]: k segments of one length, batched
            picked = [t[index].transpose(1, 2) for t in (q, k, v)]  # [k, heads, length, dim]
            attended = F.scaled_dot_product_attention(*picked)
            out[index.reshape(-1)] = attended.transpose(1, 2).reshape(-1, self.heads, self.head_dim)
        x = x + self.proj(out.view(tokens, hidden).to(x.dtype))
        gate, up = self.gate_up(self.norm2(x)).split(self.intermediate, dim=-1)
        return x + self.down(F.silu(gate) * up)


def _segments(lengths: list[int]) -> list[torch.Tensor]:
    """Consecutive runs of these lengths as index groups, runs of one length together."""
    starts: dict[int, list[int]] = {}
    first = 0
    for length in lengths:
        if length:
            starts.setdefault(length, []).append(first)
        first += length
    return [
        torch.tensor(begins)[:, None] + torch.arange(length)[None, :]
        for length, begins in starts.items()
    ]


class QwenVisionEncoder(nn.Module):
    """One image's patches in ([t * h * w, C * T * p * p], block by merge block), one row per
    merge unit out in the text model's width: [t * h * w / merge², out]."""

    def __init__(
        self, sources: Mapping[str, TensorSource], shape: QwenVisionShape, plan: WeightPlan
    ) -> None:
        super().__init__()
        self.shape = shape
        self.dtype = plan.dtype
        self.device = plan.device
        self.patch_embedding = linear_from(sources, ["patch"], plan)
        self.layers = nn.ModuleList(
            _Block(sources, f"layers.{i}.", shape, plan) for i in range(shape.layers)
        )
        self.merger_norm = _RMSNorm(sources["merger_norm.weight"], plan.device)
        self.merger_fc1 = linear_from(sources, ["merger_fc1"], plan)
        self.merger_fc2 = linear_from(sources, ["merger_fc2"], plan)
        head_dim = shape.hidden // shape.heads
        quarter = head_dim // 2  # rotary pairs per axis: height's, then width's
        exponent = torch.arange(0, quarter, 2, dtype=torch.float32) / quarter
        self.inv_freq = 1.0 / (shape.rope_theta**exponent)

    def rotary(self, grid: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [patches, 1, head_dim] of each patch's (row, column), patches in
        the processor's block order: the first half of each head's pairs turn with the row,
        the second with the column."""
        t, h, w = grid
        m = self.shape.merge
        rows = torch.arange(h)[:, None].expand(h, w)
        cols = torch.arange(w)[None, :].expand(h, w)
        order = (h // m, m, w // m, m)
        rows = rows.reshape(order).transpose(1, 2).reshape(-1).repeat(t)
        cols = cols.reshape(order).transpose(1, 2).reshape(-1).repeat(t)
        freqs = torch.cat(
            (rows[:, None] * self.inv_freq[None], cols[:, None] * self.inv_freq[None]), dim=-1
        )
        cos, sin = freqs.cos(), freqs.sin()
        return torch.cat((cos, cos), -1)[:, None], torch.cat((-sin, sin), -1)[:, None]

    def windows(self, grid: tuple[int, int, int]) -> tuple[torch.Tensor, list[int]]:
        """The merge units in window order (windows row by row, units row by row inside
        each), and each window's length in patches."""
        t, h, w = grid
        m, size = self.shape.merge, self.shape.window_units
        units_h, units_w = h // m, w // m
        unit = torch.arange(t * units_h * units_w).view(t, units_h, units_w)
        order: list[torch.Tensor] = []
        lengths: list[int] = []
        for frame in range(t):
            for top in range(0, units_h, size):
                for left in range(0, units_w, size):
                    window = unit[frame, top : top + size, left : left + size].reshape(-1)
                    order.append(window)
                    lengths.append(window.numel() * m * m)
        return torch.cat(order), lengths

    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        shape = self.shape
        per_unit = shape.merge * shape.merge
        units, lengths = self.windows(grid)
        # Patches regrouped window by window (each merge unit's patches stay together), and
        # their rotary alike; the merged rows are put back in image order at the end.
        patch_order = (units[:, None] * per_unit + torch.arange(per_unit)[None]).reshape(-1)
        x = self.patch_embedding(pixels[patch_order].to(self.device, self.dtype))
        cos, sin = self.rotary(grid)
        rope = (cos[patch_order].to(x.device), sin[patch_order].to(x.device))
        windowed = [index.to(x.device) for index in _segments(lengths)]
        whole = [index.to(x.device) for index in _segments([x.shape[0]])]
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, whole if i in shape.full_attention else windowed)
        merged = self.merger_norm(x).reshape(-1, x.shape[-1] * per_unit)
        merged = self.merger_fc2(F.gelu(self.merger_fc1(merged)))
        return merged[torch.argsort(units).to(merged.device)]


class QwenVLTower(nn.Module):
    """A VisionTower (models/vision/tower.py) for Qwen2.5-VL."""

    marker = IMAGE_TOKEN
    bidirectional = False  # causal like text; its images move positions instead (M-RoPE)

    def __init__(
        self, encoder: QwenVisionEncoder, *, image_token_id: int, image_config: QwenImageConfig
    ) -> None:
        super().__init__()
        self.encoder = encoder
        self.image_token_id = image_token_id
        self.image_config = image_config

    def plan(self, image: Image.Image) -> ImagePlan:
        pixels = patches(image, self.image_config)
        merge = self.image_config.merge
        offsets = mrope_offsets(pixels.grid, merge)
        return ImagePlan(prompt_text(pixels.grid, merge), offsets.shape[1], pixels, offsets)

    @torch.inference_mode()
    def encode(self, plan: ImagePlan) -> torch.Tensor:
        assert isinstance(plan.pixels, QwenPixels), "a plan made by another tower"
        return self.encoder(plan.pixels.patches, plan.pixels.grid)
