"""Building Qwen2.5-VL's vision tower from a Hugging Face folder: its `visual.*` tensors under
the neutral names models/vision/qwen2_5_vl.py reads, its vision config as a shape."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from modelhost.models.loading.weights import TensorSource, WeightPlan
from modelhost.models.vision.checkpoints import _renamed as renamed
from modelhost.models.vision.qwen2_5_vl import QwenVisionEncoder, QwenVisionShape, QwenVLTower
from modelhost.models.vision.qwen2_5_vl_image import IMAGE_TOKEN, QwenImageConfig

QWEN_VL_TYPES = ("qwen2_5_vl",)

# The safetensors loader files both layouts' vision tensors (`visual.*` of older saves,
# `model.visual.*` of transformers 5's) under this prefix.
_HF_PREFIX = "model.visual."
_HF_LAYER = {
    "norm1": "norm1",
    "norm2": "norm2",
    "attn.qkv": "qkv",
    "attn.proj": "proj",
    "mlp.gate_proj": "gate",
    "mlp.up_proj": "up",
    "mlp.down_proj": "down",
}
_HF_TOP = {
    "patch_embed.proj": "patch",
    "merger.ln_q": "merger_norm",
    "merger.mlp.0": "merger_fc1",
    "merger.mlp.2": "merger_fc2",
}
_HF_LAYER_NAME = re.compile(r"blocks\.(\d+)\.(.+)\.(weight|bias)$")

TokenId = Callable[[str], int | None]


def hf_qwen_tensors(sources: Mapping[str, TensorSource]) -> dict[str, TensorSource]:
    found: dict[str, TensorSource] = {}
    for key, source in sources.items():
        if not key.startswith(_HF_PREFIX):
            continue
        rest = key.removeprefix(_HF_PREFIX)
        match = _HF_LAYER_NAME.match(rest)
        name = None
        if match:
            layer, part, kind = match.groups()
            if part in _HF_LAYER:
                name = f"layers.{layer}.{_HF_LAYER[part]}.{kind}"
        else:
            stem, _, kind = rest.rpartition(".")
            if stem in _HF_TOP:
                name = f"{_HF_TOP[stem]}.{kind}"
        if name is not None:
            found[name] = renamed(source, name)  # the patch convolution seen as a linear
    return found


def hf_qwen_shape(vision: dict[str, Any]) -> QwenVisionShape:
    rope = vision.get("rope_parameters") or {}
    return QwenVisionShape(
        hidden=int(vision.get("hidden_size", 1280)),
        intermediate=int(vision.get("intermediate_size", 3420)),
        layers=int(vision.get("depth", vision.get("num_hidden_layers", 32))),
        heads=int(vision.get("num_heads", vision.get("num_attention_heads", 16))),
        patch=int(vision.get("patch_size", 14)),
        merge=int(vision.get("spatial_merge_size", 2)),
        window=int(vision.get("window_size", 112)),
        full_attention=tuple(int(i) for i in vision.get("fullatt_block_indexes", (7, 15, 23, 31))),
        rope_theta=float(rope.get("rope_theta", 10_000.0)),
    )


def hf_qwen_tower(
    directory: Path,
    raw: dict[str, Any],
    sources: Mapping[str, TensorSource],
    plan: WeightPlan,
    token_id: TokenId,
    processor: dict[str, Any],
) -> QwenVLTower:
    shape = hf_qwen_shape(raw["vision_config"])
    image_token_id = raw.get("image_token_id", token_id(IMAGE_TOKEN))
    if image_token_id is None:
        raise ValueError(f"{directory.name}: its vocabulary has no {IMAGE_TOKEN} token")
    image_config = QwenImageConfig.from_processor(processor)
    if image_config.patch != shape.patch or image_config.merge != shape.merge:
        raise ValueError(f"{directory.name}: the processor's patches differ from the tower's")
    return QwenVLTower(
        QwenVisionEncoder(hf_qwen_tensors(sources), shape, plan),
        image_token_id=int(image_token_id),
        image_config=image_config,
    )
