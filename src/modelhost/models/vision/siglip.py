"""The SigLIP vision encoder (Idefics3/SmolVLM's, Gemma 3's): patches embedded by a linear (the
patch convolution, its kernel the stride), learned position embeddings, pre-norm encoder layers
(LayerNorm, bidirectional attention, GELU-tanh MLP) and a final LayerNorm.

Its linears are built by models/loading/weights.py like the text model's, so they take the same
kernels and quantization. Parameters come from a checkpoint under the neutral names below
(`SiglipShape.names`); models/vision/checkpoints.py maps Hugging Face's and llama.cpp's onto
them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from modelhost.models.loading.weights import TensorSource, WeightPlan, linear_from
from modelhost.models.networks.layers import gelu_tanh


@dataclass(frozen=True, slots=True)
class SiglipShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    image_size: int  # the square the position embeddings were learned for
    patch: int
    eps: float
    # Idefics3's SigLIP takes any grid of patches, its positions bucketed onto the learned grid;
    # plain SigLIP (Gemma 3's) takes exactly the learned square, positions in order.
    bucketed_positions: bool = True

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch


class _LayerNorm(nn.Module):
    """LayerNorm with fp32 weights, computed in fp32 whatever the activations' dtype."""

    def __init__(
        self, sources: Mapping[str, TensorSource], stem: str, eps: float, device: torch.device
    ) -> None:
        super().__init__()
        weight, bias = sources[f"{stem}.weight"].dense(), sources[f"{stem}.bias"].dense()
        self.weight = nn.Parameter(weight.to(device), requires_grad=False)
        self.bias = nn.Parameter(bias.to(device), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.layer_norm(x.float(), self.weight.shape, self.weight, self.bias, self.eps)
        return out.to(x.dtype)


class _EncoderLayer(nn.Module):
    def __init__(
        self, sources: Mapping[str, TensorSource], prefix: str, shape: SiglipShape, plan: WeightPlan
    ) -> None:
        super().__init__()
        self.norm1 = _LayerNorm(sources, f"{prefix}norm1", shape.eps, plan.device)
        self.qkv = linear_from(sources, [f"{prefix}q", f"{prefix}k", f"{prefix}v"], plan)
        self.out = linear_from(sources, [f"{prefix}out"], plan)
        self.norm2 = _LayerNorm(sources, f"{prefix}norm2", shape.eps, plan.device)
        self.fc1 = linear_from(sources, [f"{prefix}fc1"], plan)
        self.fc2 = linear_from(sources, [f"{prefix}fc2"], plan)
        self.heads = shape.heads
        self.head_dim = shape.hidden // shape.heads

    def forward(self, x: torch.Tensor, images: int) -> torch.Tensor:
        """x: [images * length, hidden], each image's patches together (linears take 2-D)."""
        tokens, hidden = x.shape
        length = tokens // images
        qkv = self.qkv(self.norm1(x)).view(images, length, 3, self.heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [images, heads, length, dim]
        attn = F.scaled_dot_product_attention(q, k, v)
        x = x + self.out(attn.transpose(1, 2).reshape(tokens, hidden))
        return x + self.fc2(gelu_tanh(self.fc1(self.norm2(x))))


class SiglipEncoder(nn.Module):
    """Square tiles of pixels in, one hidden state per patch out: [tiles, patches, hidden]."""

    def __init__(
        self, sources: Mapping[str, TensorSource], shape: SiglipShape, plan: WeightPlan
    ) -> None:
        super().__init__()
        self.shape = shape
        self.dtype = plan.dtype
        self.patch_embedding = linear_from(sources, ["patch"], plan)
        position = sources["position.weight"].dense().to(plan.device, plan.dtype)
        self.position = nn.Parameter(position, requires_grad=False)
        self.layers = nn.ModuleList(
            _EncoderLayer(sources, f"layers.{i}.", shape, plan) for i in range(shape.layers)
        )
        self.post_norm = _LayerNorm(sources, "post_norm", shape.eps, plan.device)

    def position_ids(self, rows: int, cols: int) -> torch.Tensor:
        """Each patch's position embedding for a `rows` x `cols` grid of patches: the grid's
        fractional coordinates bucketed onto the learned grid, computed as transformers'
        Idefics3VisionEmbeddings does (so float rounding lands in the same buckets)."""
        side = self.shape.patches_per_side
        boundaries = torch.arange(1 / side, 1.0, 1 / side)

        def buckets(count: int) -> torch.Tensor:
            step = 1.0 / torch.tensor(count)
            fractions = torch.clamp(torch.arange(count, dtype=torch.float32) * step, max=1 - 1e-6)
            return torch.bucketize(fractions, boundaries, right=True)

        return (buckets(rows)[:, None] * side + buckets(cols)[None, :]).reshape(-1)

    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        tiles, channels, height, width = pixels.shape
        p = self.shape.patch
        rows, cols = height // p, width // p
        if self.shape.bucketed_positions:
            position_ids = self.position_ids(rows, cols)
        else:
            side = self.shape.patches_per_side
            if (rows, cols) != (side, side):
                raise ValueError(f"expected {side} x {side} patches, got {rows} x {cols}")
            position_ids = torch.arange(side * side)
        # The convolution with kernel = stride = p is a linear over each patch's pixels,
        # flattened in the kernel's (channel, y, x) order.
        patches = pixels.to(self.position).reshape(tiles, channels, rows, p, cols, p)
        patches = patches.permute(0, 2, 4, 1, 3, 5).reshape(tiles * rows * cols, -1)
        positions = self.position[position_ids].repeat(tiles, 1)
        x = self.patch_embedding(patches) + positions
        for layer in self.layers:
            x = layer(x, tiles)
        return self.post_norm(x).view(tiles, rows * cols, -1)
