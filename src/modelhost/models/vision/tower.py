"""What a vision tower offers the layers above it: an image planned into placeholder text and
pixels, and the pixels encoded into rows of the decoder's input-embedding space.

The engine expands each image marker of a rendered prompt into `ImagePlan.text`, tokenizes it,
and overwrites the embeddings of the `image_token_id` tokens with `encode(plan)`, in order
(models/batch.py's `embed_override`). Nothing here knows a protocol or a sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from PIL import Image


@dataclass(frozen=True)
class ImagePlan:
    """One image, preprocessed for one model."""

    # What replaces ONE occurrence of the tower's marker in the rendered prompt; tokenized, it
    # holds exactly `n_tokens` copies of the tower's `image_token_id`.
    text: str
    n_tokens: int
    pixels: Any  # the preprocessed tensors (opaque to callers)
    # M-RoPE models (Qwen2.5-VL): [3, n_tokens] (temporal, height, width) position offsets of
    # the placeholders from the image's first position. The row's positions then differ from
    # its token indices: models/vision/mrope.py computes them (ForwardBatch.mrope_positions).
    # None: the placeholders take their indices as positions, like text.
    mrope: torch.Tensor | None = None


class VisionTower(Protocol):
    # The text the model's chat template emits for one image part ({"type": "image"} in a
    # message's content list): Idefics3/SmolVLM "<image>", Gemma 3 "<start_of_image>".
    marker: str
    image_token_id: int  # the placeholder token whose input embeddings are replaced
    # One image's placeholders attend to each other both ways (Gemma 3), not only causally:
    # the step that prefills them must hold the whole image, OR that block into its masks and
    # set ForwardBatch.bidirectional.
    bidirectional: bool

    def plan(self, image: Image.Image) -> ImagePlan:
        """An RGB image, resized, split and normalised exactly as the model's processor
        config says."""
        ...

    def encode(self, plan: ImagePlan) -> torch.Tensor:
        """[n_tokens, hidden] in the decoder's input-embedding space: the rows that replace
        the placeholders' embeddings after the embedding layer's own scaling."""
        ...
