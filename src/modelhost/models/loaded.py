"""A model ready to serve: network, tokenizer, config and family, as the engine receives it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from modelhost.models.config import ModelConfig
from modelhost.models.families import Family
from modelhost.models.vision.tower import VisionTower
from modelhost.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch  # annotations only: the front process never imports PyTorch

    from modelhost.models.adapters.row_adapters import RowAdapters


@dataclass(slots=True)
class LoadedModel:
    id: str
    path: Path
    config: ModelConfig
    family: Family
    tokenizer: Tokenizer
    network: torch.nn.Module
    device: torch.device
    dtype: torch.dtype
    weights_bytes: int
    # Only the keys generation_config.json sets: temperature, top_p, top_k, repetition_penalty.
    gen_defaults: dict[str, float] = field(default_factory=dict)
    load_seconds: float = 0.0
    kv_dtype: torch.dtype | None = None  # the KV cache's, where it is not `dtype`
    # Images in: loaded exactly when `family.vision` is True (models/vision/).
    vision: VisionTower | None = None
    # The hooks that add rows' LoRA updates, once an adapter of this model is loaded
    # (models/adapters/adapter_set.py).
    row_adapters: RowAdapters | None = None

    @property
    def cache_dtype(self) -> torch.dtype:
        """The dtype the KV cache holds keys and values in."""
        return self.kv_dtype or self.dtype

    @property
    def context_length(self) -> int:
        return self.config.context_length
