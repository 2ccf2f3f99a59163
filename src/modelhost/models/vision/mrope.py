"""M-RoPE positions (Qwen2-VL, Qwen2.5-VL): each token's (temporal, height, width) rotary
position, computed from its index in the row and the row's images.

Text takes its index on all three axes, shifted by what the images before it saved: an image
whose placeholders start at index s takes s + its plan's offsets (`ImagePlan.mrope`), and the
text after it continues from one past the image's largest position, not from s + n_tokens
(transformers' get_rope_index). A text-only row's positions are its indices, so rows without
such images need nothing (ForwardBatch.mrope_positions None).

Pure functions of the row: any slice of it (a prefill chunk, a decode token, a verify step)
gets the same positions, so the KV cache and prefix reuse see one layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from modelhost.models.vision.tower import ImagePlan


class PlacedImage(Protocol):
    """An image in a row: its plan and the index of its first placeholder (the engine's
    ImageSpan is one). M-RoPE plans' placeholders are contiguous."""

    @property
    def start(self) -> int: ...

    @property
    def plan(self) -> ImagePlan: ...


def position_advance(offsets: torch.Tensor) -> int:
    """How far an image moves the positions of what follows it: one past its largest."""
    return int(offsets.max()) + 1


def mrope_positions(indices: torch.Tensor, images: Sequence[PlacedImage]) -> torch.Tensor:
    """[3, n] positions of a row's tokens at `indices` [n] (their indices in the row, any
    order); `images` the row's, in order."""
    positions = indices.to(torch.long).expand(3, -1).clone()
    shift = 0  # what the images so far saved: their advance less their token count
    for image in images:
        offsets = image.plan.mrope
        if offsets is None:
            continue
        offsets = offsets.to(positions)
        start, count = image.start, offsets.shape[1]
        inside = (indices >= start) & (indices < start + count)
        if bool(inside.any()):
            positions[:, inside] = start + shift + offsets[:, indices[inside] - start]
        saved = position_advance(offsets) - count
        positions[:, indices >= start + count] += saved
        shift += saved
    return positions


def step_mrope_positions(
    positions: torch.Tensor,
    counts: Sequence[int],
    row_images: Sequence[Sequence[PlacedImage]],
) -> torch.Tensor | None:
    """A step's [3, T] M-RoPE positions (ForwardBatch.mrope_positions): `positions` [T] the
    tokens' indices in their rows, rows laid one after another, `counts[r]` tokens of row r,
    whose images are `row_images[r]`. None when no row holds an M-RoPE image (every position
    is then its index)."""
    if not any(image.plan.mrope is not None for images in row_images for image in images):
        return None
    parts = []
    first = 0
    for count, images in zip(counts, row_images, strict=True):
        parts.append(mrope_positions(positions[first : first + count], images))
        first += count
    return torch.cat(parts, dim=1)
