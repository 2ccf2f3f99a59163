"""Idefics3 / SmolVLM image preprocessing, as transformers' Idefics3ImageProcessor (its Pillow
backend) does it: the longest edge resized to `size`, then to multiples of the tile size, cut
into tiles row by row plus the whole image shrunk to one tile, rescaled and normalised; and the
prompt text that stands for those tiles.

Every resize is Pillow's on 8-bit RGB (the processor resizes uint8 arrays through Pillow too),
so the pixels agree with transformers' to the last bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

MAX_IMAGE_SIZE = 4096  # the processor's absolute ceiling on either edge
FAKE_TOKEN = "<fake_token_around_image>"
GLOBAL_TOKEN = "<global-img>"
IMAGE_TOKEN = "<image>"


@dataclass(frozen=True, slots=True)
class Idefics3ImageConfig:
    """The processor config's settings (preprocessor_config.json), with the processor's
    defaults where a key is missing."""

    longest_edge: int = 4 * 364  # `size`: the whole image's longest edge after the first resize
    tile: int = 364  # `max_image_size`: a tile's edge, the vision encoder's input
    do_resize: bool = True
    do_splitting: bool = True
    resample: int = Image.Resampling.LANCZOS
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    std: tuple[float, ...] = (0.5, 0.5, 0.5)

    @classmethod
    def from_processor(cls, raw: dict[str, Any]) -> Idefics3ImageConfig:
        defaults = cls()
        size = raw.get("size") or {}
        tile = raw.get("max_image_size") or {}
        return cls(
            longest_edge=int(size.get("longest_edge", defaults.longest_edge)),
            tile=int(tile.get("longest_edge", defaults.tile)),
            do_resize=bool(raw.get("do_resize", True)),
            do_splitting=bool(raw.get("do_image_splitting", True)),
            resample=int(raw.get("resample", defaults.resample)),
            do_rescale=bool(raw.get("do_rescale", True)),
            rescale_factor=float(raw.get("rescale_factor", defaults.rescale_factor)),
            do_normalize=bool(raw.get("do_normalize", True)),
            mean=tuple(float(v) for v in raw.get("image_mean", defaults.mean)),
            std=tuple(float(v) for v in raw.get("image_std", defaults.std)),
        )


@dataclass(frozen=True, slots=True)
class Tiles:
    images: list[Image.Image]  # row by row, then the global image (or only the global one)
    rows: int  # 0 and 0 when the image was not split
    cols: int


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, transparency laid over white (as transformers' convert_to_rgb does)."""
    if image.mode == "RGB":
        return image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def longest_edge_size(height: int, width: int, longest: int) -> tuple[int, int]:
    """(height, width) with the longest edge set to `longest` (up or down), the other
    following the aspect ratio rounded up to an even number, then held under MAX_IMAGE_SIZE."""
    aspect = width / height
    if width >= height:
        width = longest
        height = int(width / aspect)
        height += height % 2
    else:
        height = longest
        width = int(height * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_IMAGE_SIZE:
        width, height = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE / aspect)
    elif height > width and height > MAX_IMAGE_SIZE:
        height, width = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE * aspect)
    return max(height, 1), max(width, 1)


def tile_multiple_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """(height, width) rounded up to multiples of the tile edge, the aspect ratio kept along
    the way as the processor does."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


def split(image: Image.Image, config: Idefics3ImageConfig) -> Tiles:
    image = to_rgb(image)
    resample = Image.Resampling(config.resample)
    if config.do_resize:
        height, width = longest_edge_size(image.height, image.width, config.longest_edge)
        image = image.resize((width, height), resample)
    tile = config.tile
    if not config.do_splitting:
        return Tiles([image.resize((tile, tile), resample)], 0, 0)
    height, width = tile_multiple_size(image.height, image.width, tile)
    image = image.resize((width, height), resample)
    if height <= tile and width <= tile:
        return Tiles([image], 0, 0)
    rows, cols = (height - tile) // tile + 1, (width - tile) // tile + 1
    crops = [
        image.crop((c * tile, r * tile, (c + 1) * tile, (r + 1) * tile))
        for r in range(rows)
        for c in range(cols)
    ]
    return Tiles([*crops, image.resize((tile, tile), resample)], rows, cols)


def pixel_values(tiles: Tiles, config: Idefics3ImageConfig) -> torch.Tensor:
    """[tiles, 3, tile, tile] float32, rescaled and normalised."""
    arrays = []
    for image in tiles.images:
        array: np.ndarray = np.asarray(image).transpose(2, 0, 1)  # CHW, uint8
        if config.do_rescale:
            array = (array.astype(np.float64) * config.rescale_factor).astype(np.float32)
        else:
            array = array.astype(np.float32)
        if config.do_normalize:
            mean = np.array(config.mean, dtype=np.float32)[:, None, None]
            std = np.array(config.std, dtype=np.float32)[:, None, None]
            array = (array - mean) / std
        arrays.append(array)
    return torch.from_numpy(np.stack(arrays))


def prompt_text(rows: int, cols: int, image_seq_len: int) -> str:
    """What stands for one image in the prompt: each tile's <row_r_col_c> tag and its
    placeholders, then the global image's (only the global image's when not split)."""
    placeholders = IMAGE_TOKEN * image_seq_len
    whole = f"{FAKE_TOKEN}{GLOBAL_TOKEN}{placeholders}{FAKE_TOKEN}"
    if rows == 0 and cols == 0:
        return whole
    text = ""
    for r in range(rows):
        for c in range(cols):
            text += f"{FAKE_TOKEN}<row_{r + 1}_col_{c + 1}>{placeholders}"
        text += "\n"
    return text + "\n" + whole
