"""Gemma 3's vision side (4B and up): the image resized to one square (896² by default, no
splitting), SigLIP over it, its patches average-pooled to `mm_tokens_per_image` soft tokens,
normalised (RMSNorm, (1 + w)) and projected into the text model's width, as transformers'
Gemma3MultiModalProjector does.

One image's soft tokens attend to each other both ways (a bidirectional block inside the
causal mask, as transformers and llama.cpp do): `bidirectional` tells the engine, which keeps an
image's tokens in one step (engine/scheduler.py) and ORs the block into the masks
(engine/runner.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from modelhost.models.loading import footprint
from modelhost.models.loading.weights import TensorSource
from modelhost.models.vision.idefics3_image import to_rgb
from modelhost.models.vision.siglip import SiglipEncoder
from modelhost.models.vision.tower import ImagePlan

BOI_TOKEN = "<start_of_image>"  # what the chat template writes for an image part
EOI_TOKEN = "<end_of_image>"
SOFT_TOKEN = "<image_soft_token>"  # the placeholders the tower's rows replace


@dataclass(frozen=True, slots=True)
class Gemma3ImageConfig:
    height: int = 896
    width: int = 896
    resample: int = Image.Resampling.BILINEAR
    rescale_factor: float = 1 / 255
    mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    std: tuple[float, ...] = (0.5, 0.5, 0.5)

    @classmethod
    def from_processor(cls, raw: dict[str, Any]) -> Gemma3ImageConfig:
        if raw.get("do_pan_and_scan"):
            raise ValueError("Gemma 3's pan and scan is not supported")
        defaults = cls()
        size = raw.get("size") or {}
        return cls(
            height=int(size.get("height", defaults.height)),
            width=int(size.get("width", defaults.width)),
            resample=int(raw.get("resample", defaults.resample)),
            rescale_factor=float(raw.get("rescale_factor", defaults.rescale_factor)),
            mean=tuple(float(v) for v in raw.get("image_mean", defaults.mean)),
            std=tuple(float(v) for v in raw.get("image_std", defaults.std)),
        )


def gemma3_pixels(image: Image.Image, config: Gemma3ImageConfig) -> torch.Tensor:
    """[1, 3, height, width] float32: resized (Pillow, 8-bit), rescaled, normalised."""
    resized = to_rgb(image).resize((config.width, config.height), Image.Resampling(config.resample))
    array = np.asarray(resized).transpose(2, 0, 1)
    scaled = (array.astype(np.float64) * config.rescale_factor).astype(np.float32)
    mean = np.array(config.mean, dtype=np.float32)[:, None, None]
    std = np.array(config.std, dtype=np.float32)[:, None, None]
    return torch.from_numpy((scaled - mean) / std)[None]


def gemma3_prompt_text(tokens: int) -> str:
    """What replaces one <start_of_image> of the rendered prompt (transformers' Gemma3Processor
    writes the same)."""
    return f"\n\n{BOI_TOKEN}{SOFT_TOKEN * tokens}{EOI_TOKEN}\n\n"


class Transposed:
    """A [in, out] tensor (Gemma 3's mm_input_projection_weight, used as x @ W) seen as a
    linear's [out, in] weight, in fp32."""

    def __init__(self, source: TensorSource, name: str) -> None:
        self.source, self.name, self.stored_name = source, name, source.stored_name
        self.shape: tuple[int, ...] = (source.shape[1], source.shape[0])
        self.type = footprint.F32
        self.order: torch.Tensor | None = None
        self.nbytes = source.nbytes

    def dense(self) -> torch.Tensor:
        return self.source.dense().t().contiguous()

    @contextlib.contextmanager
    def stored(self) -> Iterator[int]:
        value = self.dense()  # alive until the block ends
        yield value.data_ptr()


class Gemma3Tower(nn.Module):
    """A VisionTower (models/vision/tower.py) for Gemma 3 4B and up."""

    marker = BOI_TOKEN
    bidirectional = True

    def __init__(
        self,
        encoder: SiglipEncoder,
        norm_weight: torch.Tensor,
        projection: nn.Module,
        *,
        tokens_per_image: int,
        image_token_id: int,
        image_config: Gemma3ImageConfig,
    ) -> None:
        super().__init__()
        self.encoder = encoder
        self.norm_weight = nn.Parameter(norm_weight.float(), requires_grad=False)
        self.projection = projection
        self.tokens_per_image = tokens_per_image
        self.image_token_id = image_token_id
        self.image_config = image_config
        self.eps = encoder.shape.eps

    def plan(self, image: Image.Image) -> ImagePlan:
        pixels = gemma3_pixels(image, self.image_config)
        return ImagePlan(gemma3_prompt_text(self.tokens_per_image), self.tokens_per_image, pixels)

    @torch.inference_mode()
    def encode(self, plan: ImagePlan) -> torch.Tensor:
        states = self.encoder(plan.pixels)[0]  # [patches, hidden]
        side = self.encoder.shape.patches_per_side
        per_side = int(self.tokens_per_image**0.5)
        grid = states.float().t().reshape(1, -1, side, side)
        pooled = F.avg_pool2d(grid, side // per_side).flatten(2)[0].t()  # [tokens, hidden]
        normed = pooled * torch.rsqrt(pooled.pow(2).mean(-1, keepdim=True) + self.eps)
        normed = normed * (1.0 + self.norm_weight)
        return self.projection(normed.to(states.dtype))
