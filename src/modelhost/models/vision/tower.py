"""What the serving layers ask of a vision tower (a minimal stub of the contract; the vision
branch owns this file and its real towers)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from PIL import Image


@dataclass(frozen=True)
class ImagePlan:
    """One image, preprocessed for one model."""

    text: str  # replaces ONE occurrence of the tower's marker in the rendered prompt; tokenized,
    # it holds exactly n_tokens copies of the tower's image_token_id
    n_tokens: int
    pixels: Any  # the preprocessed tensors (opaque to callers)


class VisionTower(Protocol):
    marker: str  # what the chat template emits for one image part ({"type": "image"})
    image_token_id: int  # the placeholder token whose input embeddings are replaced

    def plan(self, image: Image.Image) -> ImagePlan: ...

    def encode(self, plan: ImagePlan) -> torch.Tensor:
        """[n_tokens, hidden] rows replacing the placeholders' input embeddings."""
        ...
