"""Qwen2-VL / Qwen2.5-VL image preprocessing, as transformers' Qwen2VLImageProcessor (its Pillow
backend) does it: the image resized to multiples of patch x merge within a pixel budget
(`smart_resize`), rescaled and normalised, then cut into patches laid out merge block by merge
block, each patch repeated over the temporal kernel (a still image is a one-frame video).

The resize is Pillow's on 8-bit RGB, as the processor's, so the pixels agree to the last bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from modelhost.models.vision.idefics3_image import to_rgb

IMAGE_TOKEN = "<|image_pad|>"
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200  # the processor refuses images longer than this to one side


@dataclass(frozen=True, slots=True)
class QwenImageConfig:
    """preprocessor_config.json's settings, the processor's defaults where a key is missing."""

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch: int = 14
    temporal_patch: int = 2
    merge: int = 2
    resample: int = Image.Resampling.BICUBIC
    do_resize: bool = True
    rescale_factor: float = 1 / 255
    do_rescale: bool = True
    do_normalize: bool = True
    mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    std: tuple[float, ...] = OPENAI_CLIP_STD

    @classmethod
    def from_processor(cls, raw: dict[str, Any]) -> QwenImageConfig:
        """`size` {shortest_edge, longest_edge} holds the pixel budget in transformers 5;
        older files say min_pixels / max_pixels (which win, as the processor lets them)."""
        defaults = cls()
        size = raw.get("size") or {}
        return cls(
            min_pixels=int(raw.get("min_pixels") or size.get("shortest_edge", defaults.min_pixels)),
            max_pixels=int(raw.get("max_pixels") or size.get("longest_edge", defaults.max_pixels)),
            patch=int(raw.get("patch_size", defaults.patch)),
            temporal_patch=int(raw.get("temporal_patch_size", defaults.temporal_patch)),
            merge=int(raw.get("merge_size", defaults.merge)),
            resample=int(raw.get("resample", defaults.resample)),
            do_resize=bool(raw.get("do_resize", True)),
            rescale_factor=float(raw.get("rescale_factor", defaults.rescale_factor)),
            do_rescale=bool(raw.get("do_rescale", True)),
            do_normalize=bool(raw.get("do_normalize", True)),
            mean=tuple(float(v) for v in raw.get("image_mean", defaults.mean)),
            std=tuple(float(v) for v in raw.get("image_std", defaults.std)),
        )


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """(height, width) rounded to multiples of `factor`, scaled (aspect ratio kept) into
    [min_pixels, max_pixels]."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"the image's aspect ratio is over {MAX_ASPECT_RATIO}: {width}x{height}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True, slots=True)
class QwenPixels:
    patches: torch.Tensor  # [t * h * w, channels * temporal_patch * patch * patch] float32
    grid: tuple[int, int, int]  # (t, h, w) in patches


def patches(image: Image.Image, config: QwenImageConfig) -> QwenPixels:
    """The image's flattened patches and its (t, h, w) patch grid."""
    image = to_rgb(image)
    if config.do_resize:
        factor = config.patch * config.merge
        height, width = smart_resize(
            image.height, image.width, factor, config.min_pixels, config.max_pixels
        )
        image = image.resize((width, height), Image.Resampling(config.resample))
    array: np.ndarray = np.asarray(image).transpose(2, 0, 1)  # CHW, uint8
    if config.do_rescale:
        array = (array.astype(np.float64) * config.rescale_factor).astype(np.float32)
    else:
        array = array.astype(np.float32)
    if config.do_normalize:
        mean = np.array(config.mean, dtype=np.float32)[:, None, None]
        std = np.array(config.std, dtype=np.float32)[:, None, None]
        array = (array - mean) / std
    channels, height, width = array.shape
    p, m, t = config.patch, config.merge, config.temporal_patch
    grid_h, grid_w = height // p, width // p
    blocks = array.reshape(channels, grid_h // m, m, p, grid_w // m, m, p)
    blocks = blocks.transpose(1, 4, 2, 5, 0, 3, 6)  # (gh, gw, mh, mw, C, ph, pw)
    # A still image fills every frame of the temporal kernel.
    frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], t, p, p))
    flat = np.ascontiguousarray(frames).reshape(grid_h * grid_w, channels * t * p * p)
    return QwenPixels(torch.from_numpy(flat), (1, grid_h, grid_w))


def prompt_text(grid: tuple[int, int, int], merge: int) -> str:
    """What replaces the template's one <|image_pad|>: one per merged patch (the template
    writes <|vision_start|> and <|vision_end|> around it)."""
    t, h, w = grid
    return IMAGE_TOKEN * (t * h * w // (merge * merge))


def mrope_offsets(grid: tuple[int, int, int], merge: int) -> torch.Tensor:
    """[3, tokens]: each image token's (temporal, height, width) position offset from the
    image's first position, as get_rope_index lays them (a still image's frame is 0)."""
    t, h, w = grid[0], grid[1] // merge, grid[2] // merge
    frames, rows, cols = torch.meshgrid(
        torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"
    )
    return torch.stack((frames, rows, cols)).reshape(3, -1)
