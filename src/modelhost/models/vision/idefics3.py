"""Idefics3 / SmolVLM's vision side: SigLIP over each tile, the connector (pixel shuffle by
`scale_factor`, then one linear into the text model's width), and the preprocessing of
models/vision/idefics3_image.py. The text side is the Llama network."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from PIL import Image
from torch import nn

from modelhost.models.vision.idefics3_image import (
    IMAGE_TOKEN,
    Idefics3ImageConfig,
    pixel_values,
    prompt_text,
    split,
)
from modelhost.models.vision.siglip import SiglipEncoder
from modelhost.models.vision.tower import ImagePlan


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """[tiles, side * side, dim] -> [tiles, side * side / scale², dim * scale²]: each scale x
    scale block of patches becomes one token, its patches' states side by side in the order
    transformers' Idefics3Connector lays them."""
    tiles, length, dim = x.shape
    side = int(length**0.5)
    x = x.view(tiles, side, side // scale, dim * scale)
    x = x.permute(0, 2, 1, 3).reshape(tiles, side // scale, side // scale, dim * scale * scale)
    return x.permute(0, 2, 1, 3).reshape(tiles, length // (scale * scale), dim * scale * scale)


@dataclass(frozen=True, slots=True)
class _Pixels:
    tiles: torch.Tensor  # [tiles, 3, tile, tile]


class Idefics3Tower(nn.Module):
    """A VisionTower (models/vision/tower.py) for Idefics3 and SmolVLM."""

    marker = IMAGE_TOKEN
    bidirectional = False

    def __init__(
        self,
        encoder: SiglipEncoder,
        projector: nn.Module,
        *,
        scale_factor: int,
        image_token_id: int,
        image_config: Idefics3ImageConfig,
    ) -> None:
        super().__init__()
        self.encoder = encoder
        self.projector = projector
        self.scale_factor = scale_factor
        self.image_token_id = image_token_id
        self.image_config = image_config
        patches = (image_config.tile // encoder.shape.patch) ** 2
        self.image_seq_len = patches // (scale_factor * scale_factor)

    def plan(self, image: Image.Image) -> ImagePlan:
        tiles = split(image, self.image_config)
        text = prompt_text(tiles.rows, tiles.cols, self.image_seq_len)
        n_tokens = len(tiles.images) * self.image_seq_len
        return ImagePlan(text, n_tokens, _Pixels(pixel_values(tiles, self.image_config)))

    @torch.inference_mode()
    def encode(self, plan: ImagePlan) -> torch.Tensor:
        assert isinstance(plan.pixels, _Pixels), "a plan made by another tower"
        states = self.encoder(plan.pixels.tiles)
        merged = pixel_shuffle(states, self.scale_factor)
        return self.projector(merged.reshape(-1, merged.shape[-1]))
