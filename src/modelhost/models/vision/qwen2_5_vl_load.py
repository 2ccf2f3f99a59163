"""Building Qwen2.5-VL's vision tower from a Hugging Face folder: its `visual.*` tensors under
the neutral names models/vision/qwen2_5_vl.py reads, its vision config as a shape."""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from modelhost.models.loading.gguf_header import GGUFFile
from modelhost.models.loading.weights import TensorSource, WeightPlan
from modelhost.models.vision.checkpoints import our_name, renamed
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


# llama.cpp's mmproj names (its converter, conversion/qwenvl.py) to ours: q, k and v split,
# the patch convolution split by frame (`v.patch_embd.weight` and `.weight.1`).
_GGUF_LAYER = {
    "ln1": "norm1",
    "ln2": "norm2",
    "attn_q": "q",
    "attn_k": "k",
    "attn_v": "v",
    "attn_out": "proj",
    "ffn_gate": "gate",
    "ffn_up": "up",
    "ffn_down": "down",
}
_GGUF_TOP = {"v.post_ln": "merger_norm", "mm.0": "merger_fc1", "mm.2": "merger_fc2"}
_GGUF_LAYER_NAME = re.compile(r"v\.blk\.(\d+)\.(\w+)\.(weight|bias)$")
MMPROJ_QWEN_VL = ("qwen2.5vl_merger",)
# llama.cpp's bounds on a Qwen-VL image, in tokens, where the mmproj file names no pixels.
LLAMA_CPP_TOKENS = (8, 4096)


class _FramesStacked:
    """The patch convolution's frames ([out, C, p, p] each) as one linear [out, C*T*p*p] in
    the order Hugging Face's Conv3d kernel flattens (channel, frame, y, x). F32, read whole."""

    def __init__(self, frames: list[TensorSource]) -> None:
        first = frames[0]
        self.frames = frames
        self.name, self.stored_name = "patch.weight", first.stored_name
        out, *rest = first.shape
        self.shape: tuple[int, ...] = (out, len(frames) * math.prod(rest))
        self.type = 0  # F32
        self.order: torch.Tensor | None = None
        self.nbytes = sum(frame.nbytes for frame in frames)

    def dense(self) -> torch.Tensor:
        stacked = torch.stack([frame.dense() for frame in self.frames], dim=2)
        return stacked.reshape(self.shape)

    @contextlib.contextmanager
    def stored(self) -> Iterator[int]:
        values = self.dense().contiguous()
        yield values.data_ptr()


def gguf_qwen_tensors(sources: Mapping[str, TensorSource]) -> dict[str, TensorSource]:
    found: dict[str, TensorSource] = {}
    for key, source in sources.items():
        name = our_name(key, _GGUF_LAYER_NAME, _GGUF_LAYER, _GGUF_TOP)
        if name is not None:
            found[name] = renamed(source, name)
    frames = [sources[k] for k in ("v.patch_embd.weight", "v.patch_embd.weight.1") if k in sources]
    if frames:
        found["patch.weight"] = _FramesStacked(frames)
    return found


def gguf_qwen_tower(
    header: GGUFFile, sources: Mapping[str, TensorSource], plan: WeightPlan, token_id: TokenId
) -> QwenVLTower:
    """The tower of a `qwen2.5vl_merger` mmproj (its header read, its tensors at hand)."""
    name = header.path.name

    def number(key: str, default: Any = None) -> Any:
        value = header.field(f"clip.vision.{key}", default)
        if value is None:
            raise ValueError(f"{name} lacks clip.vision.{key}")
        return value

    layers = int(number("block_count"))
    pattern = int(number("n_wa_pattern"))
    shape = QwenVisionShape(
        hidden=int(number("embedding_length")),
        intermediate=int(number("feed_forward_length")),
        layers=layers,
        heads=int(number("attention.head_count")),
        patch=int(number("patch_size")),
        merge=int(number("spatial_merge_size", 2)),
        window=int(number("window_size", 112)),
        full_attention=tuple(i for i in range(layers) if (i + 1) % pattern == 0),
    )
    unit = (shape.patch * shape.merge) ** 2
    image_config = QwenImageConfig(
        min_pixels=int(number("image_min_pixels", LLAMA_CPP_TOKENS[0] * unit)),
        max_pixels=int(number("image_max_pixels", LLAMA_CPP_TOKENS[1] * unit)),
        patch=shape.patch,
        merge=shape.merge,
        mean=tuple(float(v) for v in number("image_mean")),
        std=tuple(float(v) for v in number("image_std")),
    )
    image_token_id = token_id(IMAGE_TOKEN)
    if image_token_id is None:
        raise ValueError(f"the model paired with {name} has no {IMAGE_TOKEN} token")
    return QwenVLTower(
        QwenVisionEncoder(gguf_qwen_tensors(sources), shape, plan),
        image_token_id=image_token_id,
        image_config=image_config,
    )
