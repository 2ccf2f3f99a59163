"""Which vision tower a model has, and building it: from a Hugging Face folder's multimodal
checkpoint, or from a llama.cpp `mmproj` GGUF beside a text GGUF (models/vision/pairing.py says
which)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from modelhost.models.loading.gguf_header import GGUFFile
from modelhost.models.loading.hf_config import read_json
from modelhost.models.loading.load_gguf import FileReader, GGUFTensor
from modelhost.models.loading.weights import TensorSource, WeightPlan, linear_from
from modelhost.models.vision.checkpoints import gguf_vision_tensors, hf_vision_tensors
from modelhost.models.vision.gemma3 import SOFT_TOKEN, Gemma3ImageConfig, Gemma3Tower, Transposed
from modelhost.models.vision.idefics3 import Idefics3Tower
from modelhost.models.vision.idefics3_image import IMAGE_TOKEN, Idefics3ImageConfig
from modelhost.models.vision.pairing import MMPROJ_PROJECTORS
from modelhost.models.vision.qwen2_5_vl_load import (
    MMPROJ_QWEN_VL,
    QWEN_VL_TYPES,
    gguf_qwen_tower,
    hf_qwen_tower,
)
from modelhost.models.vision.siglip import SiglipEncoder, SiglipShape
from modelhost.models.vision.tower import VisionTower

# Hugging Face `model_type`s whose folders carry a vision tower we build and serve; a "gemma3"
# folder with a vision_config too (Gemma 3 4B and up: gemma3_hf_tower).
IDEFICS3_TYPES = ("idefics3", "smolvlm")
VISION_MODEL_TYPES = IDEFICS3_TYPES + QWEN_VL_TYPES
TokenId = Callable[[str], int | None]


class UnsupportedProjector(ValueError):
    """An mmproj file whose projector this server does not compute."""


def processor_settings(directory: Path) -> dict[str, Any]:
    """preprocessor_config.json, with processor_config.json's image processor over it."""
    settings = read_json(directory / "preprocessor_config.json")
    processor = read_json(directory / "processor_config.json")
    return {**settings, **processor, **(processor.get("image_processor") or {})}


def hf_tower(
    directory: Path,
    raw: dict[str, Any],
    sources: Mapping[str, TensorSource],
    plan: WeightPlan,
    token_id: TokenId,
) -> VisionTower | None:
    """The folder's vision tower, None for a text-only model."""
    if raw.get("model_type") in QWEN_VL_TYPES:
        settings = processor_settings(directory)
        return hf_qwen_tower(directory, raw, sources, plan, token_id, settings)
    if raw.get("model_type") == "gemma3" and "vision_config" in raw:
        return gemma3_hf_tower(directory, raw, sources, plan, token_id)
    if raw.get("model_type") not in IDEFICS3_TYPES:
        return None
    vision = raw["vision_config"]
    shape = SiglipShape(
        hidden=int(vision.get("hidden_size", 1152)),
        intermediate=int(vision.get("intermediate_size", 3072)),
        layers=int(vision.get("num_hidden_layers", 12)),
        heads=int(vision.get("num_attention_heads", 16)),
        image_size=int(vision.get("image_size", 224)),
        patch=int(vision.get("patch_size", 32)),
        eps=float(vision.get("layer_norm_eps", 1e-6)),
    )
    projector = {"model.connector.modality_projection.proj.weight": "projector.weight"}
    tensors = hf_vision_tensors(sources, ("model.vision_model.",), projector)
    image_token_id = raw.get("image_token_id", token_id(IMAGE_TOKEN))
    if image_token_id is None:
        raise ValueError(f"{directory.name}: its vocabulary has no {IMAGE_TOKEN} token")
    return Idefics3Tower(
        SiglipEncoder(tensors, shape, plan),
        linear_from(tensors, ["projector"], plan),
        scale_factor=int(raw.get("scale_factor", 2)),
        image_token_id=int(image_token_id),
        image_config=Idefics3ImageConfig.from_processor(processor_settings(directory)),
    )


def mmproj_tower(path: Path, plan: WeightPlan, token_id: TokenId) -> VisionTower:
    """The tower an mmproj GGUF holds, on the text model's vocabulary (`token_id`)."""
    header = GGUFFile(path)
    projector = header.field("clip.projector_type") or header.field("clip.vision.projector_type")
    if projector not in MMPROJ_PROJECTORS:
        raise UnsupportedProjector(f"{path.name}: vision projector {projector!r} is not supported")

    if projector in MMPROJ_QWEN_VL:
        reader = FileReader(path)
        try:
            raw = {t["name"]: GGUFTensor(reader, t["name"], t, None) for t in header.tensors}
            return gguf_qwen_tower(header, raw, plan, token_id)
        finally:
            reader.release()
    if projector == "gemma3":
        return gemma3_mmproj_tower(path, plan, token_id)

    def number(key: str, default: Any = None) -> Any:
        value = header.field(f"clip.vision.{key}", default)
        if value is None:
            raise ValueError(f"{path.name} lacks clip.vision.{key}")
        return value

    shape = SiglipShape(
        hidden=int(number("embedding_length")),
        intermediate=int(number("feed_forward_length")),
        layers=int(number("block_count")),
        heads=int(number("attention.head_count")),
        image_size=int(number("image_size")),
        patch=int(number("patch_size")),
        eps=float(number("attention.layer_norm_epsilon", 1e-6)),
    )
    image_token_id = token_id(IMAGE_TOKEN)
    if image_token_id is None:
        raise ValueError(f"the model paired with {path.name} has no {IMAGE_TOKEN} token")
    tile = shape.image_size
    image_config = Idefics3ImageConfig(
        longest_edge=int(number("preproc_image_size", tile)),
        tile=tile,
        mean=tuple(float(v) for v in number("image_mean", (0.5, 0.5, 0.5))),
        std=tuple(float(v) for v in number("image_std", (0.5, 0.5, 0.5))),
    )
    reader = FileReader(path)
    try:
        raw = {t["name"]: GGUFTensor(reader, t["name"], t, None) for t in header.tensors}
        tensors = gguf_vision_tensors(raw)
        encoder = SiglipEncoder(tensors, shape, plan)
        connector = linear_from(tensors, ["projector"], plan)
    finally:
        reader.release()
    return Idefics3Tower(
        encoder,
        connector,
        scale_factor=int(number("projector.scale_factor", 2)),
        image_token_id=image_token_id,
        image_config=image_config,
    )


def gemma3_hf_tower(
    directory: Path,
    raw: dict[str, Any],
    sources: Mapping[str, TensorSource],
    plan: WeightPlan,
    token_id: TokenId,
) -> Gemma3Tower:
    """A Gemma 3 folder's tower (its soft tokens attend to each other both ways: the engine
    keeps an image in one step and ORs its block into the masks)."""
    vision = raw["vision_config"]
    shape = SiglipShape(
        hidden=int(vision.get("hidden_size", 1152)),
        intermediate=int(vision.get("intermediate_size", 4304)),
        layers=int(vision.get("num_hidden_layers", 27)),
        heads=int(vision.get("num_attention_heads", 16)),
        image_size=int(vision.get("image_size", 896)),
        patch=int(vision.get("patch_size", 14)),
        eps=float(vision.get("layer_norm_eps", 1e-6)),
        bucketed_positions=False,
    )
    # The hub's files say vision_tower.vision_model.*, transformers 5 writes vision_tower.*;
    # both arrive here under model. (models/loading/load_safetensors.py).
    prefix = "model.multi_modal_projector."
    projector = {f"{prefix}mm_soft_emb_norm.weight": "projector_norm.weight"}
    towers = ("model.vision_tower.vision_model.", "model.vision_tower.")
    tensors = hf_vision_tensors(sources, towers, projector)
    weight = sources[f"{prefix}mm_input_projection_weight"]
    tensors["projector.weight"] = Transposed(weight, "projector.weight")
    # Gemma 3's config.json says image_token_index (transformers' attribute is image_token_id)
    image_token_id = raw.get("image_token_index", raw.get("image_token_id"))
    if image_token_id is None:
        image_token_id = token_id(SOFT_TOKEN)
    if image_token_id is None:
        raise ValueError(f"{directory.name}: its vocabulary has no {SOFT_TOKEN} token")
    return Gemma3Tower(
        SiglipEncoder(tensors, shape, plan),
        tensors["projector_norm.weight"].dense().to(plan.device),
        linear_from(tensors, ["projector"], plan),
        tokens_per_image=int(raw.get("mm_tokens_per_image", 256)),
        image_token_id=int(image_token_id),
        image_config=Gemma3ImageConfig.from_processor(processor_settings(directory)),
    )


def gemma3_mmproj_tower(path: Path, plan: WeightPlan, token_id: TokenId) -> Gemma3Tower:
    """A Gemma 3 mmproj's tower (llama.cpp's converter: projector `gemma3`, the projection
    kept as transformers stores it, the soft-token norm stored as 1 + w)."""
    header = GGUFFile(path)

    def field(key: str, default: Any) -> Any:
        return header.field(f"clip.vision.{key}", default)

    shape = SiglipShape(
        hidden=int(field("embedding_length", 1152)),
        intermediate=int(field("feed_forward_length", 4304)),
        layers=int(field("block_count", 27)),
        heads=int(field("attention.head_count", 16)),
        image_size=int(field("image_size", 896)),
        patch=int(field("patch_size", 14)),
        eps=float(field("attention.layer_norm_epsilon", 1e-6)),
        bucketed_positions=False,
    )
    per_side = shape.patches_per_side // int(field("projector.scale_factor", 4))
    image_token_id = token_id(SOFT_TOKEN)
    if image_token_id is None:
        raise ValueError(f"the model paired with {path.name} has no {SOFT_TOKEN} token")
    size = shape.image_size
    image_config = Gemma3ImageConfig(
        height=size,
        width=size,
        mean=tuple(float(v) for v in field("image_mean", (0.5, 0.5, 0.5))),
        std=tuple(float(v) for v in field("image_std", (0.5, 0.5, 0.5))),
    )
    reader = FileReader(path)
    try:
        raw = {t["name"]: GGUFTensor(reader, t["name"], t, None) for t in header.tensors}
        tensors = gguf_vision_tensors(raw)
        tensors["projector.weight"] = Transposed(tensors["projector.weight"], "projector.weight")
        encoder = SiglipEncoder(tensors, shape, plan)
        norm = tensors["projector_norm.weight"].dense() - 1.0  # the file holds 1 + w
        projection = linear_from(tensors, ["projector"], plan)
    finally:
        reader.release()
    return Gemma3Tower(
        encoder,
        norm.to(plan.device),
        projection,
        tokens_per_image=per_side * per_side,
        image_token_id=image_token_id,
        image_config=image_config,
    )
