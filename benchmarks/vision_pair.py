"""Random-weight GGUF + mmproj pairs at real vision models' shapes, written as llama.cpp's
converter writes them, so modelhost and llama-server read the same files (issue 40).

- SmolVLM-256M/500M: the text model a `llama` GGUF (SmolLM2's tokenizer with the image tokens
  added as control tokens; Q8_0, since 576 is no multiple of the 256 K-quant blocks need) by
  benchmarks/synthetic_gguf.py, and `mmproj-<name>.gguf` beside it: projector `idefics3`,
  SigLIP-B/16 at 512² (768 wide, 12 layers), pixel shuffle by 4, its 2-D weights F16 (as
  llama.cpp ships them), embeddings, norms and biases F32.
- Gemma 3 4B: the text model a `gemma3` GGUF (Gemma 3 4B's shapes: 34 layers, 2560 wide, 8
  heads of 256, 4 KV heads, 10240-wide MLP, windows of 1024; SmolLM2's tokenizer with Gemma's
  turn and image tokens added, where the real file has Gemma's 262k vocabulary; Q4_K_M, as
  llama.cpp's releases ship it) and `mmproj-<name>.gguf` beside it: projector `gemma3`,
  SigLIP-so400m at 896² (1152 wide, 27 layers, 4304-wide MLP, 14-pixel patches), 256 soft
  tokens, projection into 2560.

Weights are random at an initialised model's spread (std 0.02, norms ~1): cost depends on
shapes, not on what the weights learned.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np

sys.path.append(str(Path(__file__).resolve().parent))  # its sibling modules, shadowing nothing
from synthetic_gguf import Shape, write_synthetic_gguf  # noqa: E402

IMAGE_TOKENS = (
    "<fake_token_around_image>",
    "<image>",
    "<global-img>",
    "<end_of_utterance>",
    *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)),
)
SMOLVLM_TEXT = {
    "256m": Shape(hidden=576, layers=30, heads=9, kv_heads=3, head_dim=64, ffn=1536, tied=False),
    "500m": Shape(hidden=960, layers=32, heads=15, kv_heads=5, head_dim=64, ffn=2560, tied=False),
}
GEMMA_TOKENS = (
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
)
GEMMA3_4B_TEXT = Shape(
    hidden=2560,
    layers=34,
    heads=8,
    kv_heads=4,
    head_dim=256,
    ffn=10240,
    tied=True,
    vocab=49152 + len(GEMMA_TOKENS),
    rope_theta=1_000_000.0,
    rms_eps=1e-6,
    gemma3_window=1024,
)
WEIGHT_STD = 0.02


def _siglip_tensors(prefix: str, hidden: int, ffn: int, layers: int, patch: int, side: int):
    """(Hugging Face name, shape) of every SigLIP tensor under `prefix`."""
    yield f"{prefix}embeddings.patch_embedding.weight", (hidden, 3, patch, patch)
    yield f"{prefix}embeddings.patch_embedding.bias", (hidden,)
    yield f"{prefix}embeddings.position_embedding.weight", (side * side, hidden)
    for i in range(layers):
        layer = f"{prefix}encoder.layers.{i}."
        for part in ("q_proj", "k_proj", "v_proj", "out_proj"):
            yield f"{layer}self_attn.{part}.weight", (hidden, hidden)
            yield f"{layer}self_attn.{part}.bias", (hidden,)
        for norm in ("layer_norm1", "layer_norm2"):
            yield f"{layer}{norm}.weight", (hidden,)
            yield f"{layer}{norm}.bias", (hidden,)
        yield f"{layer}mlp.fc1.weight", (ffn, hidden)
        yield f"{layer}mlp.fc1.bias", (ffn,)
        yield f"{layer}mlp.fc2.weight", (hidden, ffn)
        yield f"{layer}mlp.fc2.bias", (hidden,)
    yield f"{prefix}post_layernorm.weight", (hidden,)
    yield f"{prefix}post_layernorm.bias", (hidden,)


def _random(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if len(shape) == 1:
        if "norm" in name and name.endswith("weight"):
            return (1.0 + WEIGHT_STD * rng.standard_normal(shape)).astype(np.float32)
        return (WEIGHT_STD * rng.standard_normal(shape)).astype(np.float32)
    values = (WEIGHT_STD * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    # The converter keeps embeddings in F32 and writes the other 2-D weights in the out type
    return values if ".embeddings." in name else values.astype(np.float16)


def _write_mmproj(
    path: Path,
    projector: str,
    *,
    hidden: int,
    ffn: int,
    layers: int,
    heads: int,
    image: int,
    patch: int,
    projection: int,
    scale_factor: int,
    tensors: list[tuple[str, tuple[int, ...]]],
    preproc: int | None = None,
) -> Path:
    writer = gguf.GGUFWriter(path, "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_clip_has_vision_encoder(True)
    writer.add_vision_projection_dim(projection)
    writer.add_vision_image_size(image)
    writer.add_vision_patch_size(patch)
    writer.add_vision_embedding_length(hidden)
    writer.add_vision_feed_forward_length(ffn)
    writer.add_vision_block_count(layers)
    writer.add_vision_head_count(heads)
    writer.add_vision_image_mean([0.5, 0.5, 0.5])
    writer.add_vision_image_std([0.5, 0.5, 0.5])
    writer.add_clip_projector_type(projector)
    writer.add_vision_attention_layernorm_eps(1e-6)
    writer.add_vision_projector_scale_factor(scale_factor)
    writer.add_vision_use_gelu(True)
    if preproc is not None:
        writer.add_vision_preproc_image_size(preproc)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, layers)
    rng = np.random.default_rng(0)
    for name, shape in tensors:
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        # (Gemma's soft-token norm, stored as 1 + w, comes out ~1: w ~ 0, as initialised)
        writer.add_tensor(gguf_name, _random(name, shape, rng))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_smolvlm_pair(directory: Path, shape: str = "256m", text_type: str = "Q8_0") -> Path:
    """smolvlm-<shape>.gguf and mmproj-smolvlm-<shape>.gguf in `directory` (kept when there
    already); returns the text model's path."""
    directory.mkdir(parents=True, exist_ok=True)
    model = directory / f"smolvlm-{shape}.gguf"
    mmproj = directory / f"mmproj-smolvlm-{shape}.gguf"
    text = SMOLVLM_TEXT[shape]
    if not model.is_file():
        dims = replace(text, vocab=49152 + len(IMAGE_TOKENS), rope_theta=1e5)
        write_synthetic_gguf(model, dims, text_type, added_tokens=IMAGE_TOKENS)
    if not mmproj.is_file():
        hidden, ffn, layers, patch, image, scale = 768, 3072, 12, 16, 512, 4
        tensors = list(_siglip_tensors("model.vision_model.", hidden, ffn, layers, patch, 32))
        merged = hidden * scale * scale
        tensors.append(("model.connector.modality_projection.proj.weight", (text.hidden, merged)))
        _write_mmproj(
            mmproj,
            gguf.VisionProjectorType.IDEFICS3,
            hidden=hidden,
            ffn=ffn,
            layers=layers,
            heads=12,
            image=image,
            patch=patch,
            projection=text.hidden,
            scale_factor=scale,
            tensors=tensors,
            preproc=2048,  # SmolVLM's processor: longest edge 2048, then tiles of 512
        )
    return model


def write_gemma3_mmproj(path: Path, text_hidden: int = 2560) -> Path:
    """Gemma 3 4B's mmproj (kept when there already)."""
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    hidden, ffn, layers, patch, image = 1152, 4304, 27, 14, 896
    prefix = "vision_tower.vision_model."
    tensors = list(_siglip_tensors(prefix, hidden, ffn, layers, patch, image // patch))
    tensors.append(("multi_modal_projector.mm_input_projection.weight", (hidden, text_hidden)))
    tensors.append(("multi_modal_projector.mm_soft_emb_norm.weight", (hidden,)))
    return _write_mmproj(
        path,
        gguf.VisionProjectorType.GEMMA3,
        hidden=hidden,
        ffn=ffn,
        layers=layers,
        heads=16,
        image=image,
        patch=patch,
        projection=text_hidden,
        scale_factor=(image // patch) // 16,  # 64 x 64 patches pooled to 16 x 16 soft tokens
        tensors=tensors,
    )


def write_gemma3_pair(directory: Path, text_type: str = "Q4_K_M") -> Path:
    """gemma3-4b.gguf and mmproj-gemma3-4b.gguf in `directory` (kept when there already);
    returns the text model's path."""
    directory.mkdir(parents=True, exist_ok=True)
    model = directory / "gemma3-4b.gguf"
    if not model.is_file():
        write_synthetic_gguf(model, GEMMA3_4B_TEXT, text_type, added_tokens=GEMMA_TOKENS)
    write_gemma3_mmproj(directory / "mmproj-gemma3-4b.gguf", GEMMA3_4B_TEXT.hidden)
    return model
