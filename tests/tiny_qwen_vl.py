"""A tiny Qwen2.5-VL checkpoint (random weights; the donor's real byte-level BPE tokenizer, which
has ChatML's <|im_start|> and <|im_end|>, with Qwen's vision tokens added), made with
transformers' own classes, and transformers' processor and model for it."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import torch
import transformers
from gguf.quants import quantize
from PIL import Image
from safetensors.torch import load_file, save_file
from tiny_gguf import write_gguf_from_hf
from tiny_models import SHAPE
from tokenizers import Tokenizer as TokenizerBackend

from modelhost.models.loaded import LoadedModel

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# Four layers, windows of 4 x 4 merge units (112 pixels) except layers 1 and 3 (full).
VISION = dict(
    depth=4,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=112,
    fullatt_block_indexes=[1, 3],
)
MROPE_SECTION = [2, 3, 3]  # of the 8 frequency pairs of a 16-wide head
MIN_PIXELS = 56 * 56
MAX_PIXELS = 28 * 28 * 64  # at most 64 image tokens


def image_processor() -> transformers.Qwen2VLImageProcessorPil:
    return transformers.Qwen2VLImageProcessorPil(
        min_pixels=MIN_PIXELS,
        max_pixels=MAX_PIXELS,
        image_mean=[0.5, 0.4, 0.3],
        image_std=[0.2, 0.3, 0.25],
    )


def make_tiny_qwen_vl(directory: Path, donor: LoadedModel) -> Path:
    """config.json, model.safetensors, tokenizer files and the image processor's config."""
    backend = TokenizerBackend.from_str(donor.tokenizer.backend.to_str())
    backend.add_special_tokens(VISION_TOKENS)
    backend.save(str(directory / "tokenizer.json"))
    vocab = backend.get_vocab_size(with_added_tokens=True)
    token = backend.token_to_id
    config = transformers.Qwen2_5_VLConfig(
        vision_config=dict(VISION, out_hidden_size=SHAPE["hidden_size"], initializer_range=0.2),
        text_config=dict(
            SHAPE,
            vocab_size=vocab,
            initializer_range=0.3,
            max_position_embeddings=1024,
            rope_parameters=dict(
                rope_type="default", rope_theta=10_000.0, mrope_section=MROPE_SECTION
            ),
            bos_token_id=None,
            eos_token_id=token("<|im_end|>"),
        ),
        image_token_id=token("<|image_pad|>"),
        video_token_id=token("<|video_pad|>"),
        vision_start_token_id=token("<|vision_start|>"),
        vision_end_token_id=token("<|vision_end|>"),
    )
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    with torch.no_grad():  # random norms and biases, so none hides behind 1 or 0
        for name, param in model.named_parameters():
            if "norm" in name or "ln_q" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.uniform_(-0.3, 0.3)
    model.save_pretrained(directory)
    settings = {"eos_token": "<|im_end|>", "add_bos_token": False}
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    image_processor().save_pretrained(directory)
    return directory


def reference_inputs(directory: Path, prompt: str, image: Image.Image) -> dict[str, torch.Tensor]:
    """What transformers' Qwen2_5_VLProcessor makes of one prompt and image (it cannot be
    built here without torchvision's video processor): the image processor's pixels and
    grid, the prompt's <|image_pad|> repeated once per merged patch, then tokenized, and the
    token types get_rope_index reads (1 for image tokens)."""
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(directory / "tokenizer.json"), bos_token=None, eos_token=None
    )
    pixels = image_processor()(images=[image], return_tensors="pt")
    grid = pixels["image_grid_thw"]
    count = int(grid[0].prod()) // VISION["spatial_merge_size"] ** 2
    text = prompt.replace("<|image_pad|>", "<|image_pad|>" * count)
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    image_token = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    return dict(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        mm_token_type_ids=(ids == image_token).int(),
        pixel_values=pixels["pixel_values"],
        image_grid_thw=grid,
    )


def reference_qwen_vl(directory: Path) -> torch.nn.Module:
    return transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def write_qwen_vl_gguf(
    directory: Path, out: Path, qtype: str = "F32", chat_template: str | None = None
) -> Path:
    """The checkpoint as llama.cpp's converter writes it: the text model as a `qwen2vl` GGUF
    (M-RoPE's sections padded to four, the vision tokens in its vocabulary) and the vision
    tower as `mmproj-<name>.gguf` beside it, in a folder `out`. Returns the text model's path."""
    out.mkdir(parents=True, exist_ok=True)
    raw = json.loads((directory / "config.json").read_text())
    text_dir = out / "text-checkpoint"
    text_dir.mkdir(exist_ok=True)
    text_config = {**raw["text_config"], "tie_word_embeddings": False}
    (text_dir / "config.json").write_text(json.dumps(text_config))
    tensors = load_file(str(directory / "model.safetensors"))
    # transformers saves Qwen2.5-VL in its older layout: model.layers.*, visual.*, lm_head
    text = {name: value for name, value in tensors.items() if not name.startswith("visual.")}
    save_file(text, str(text_dir / "model.safetensors"))
    model_path = write_gguf_from_hf(
        text_dir, out / "tiny-qwen-vl.gguf", qtype, VISION_TOKENS, chat_template
    )
    write_qwen_mmproj(directory, out / "mmproj-tiny-qwen-vl.gguf", qtype)
    return model_path


def write_qwen_mmproj(directory: Path, path: Path, qtype: str = "F32") -> Path:
    """The vision tower and merger as a `qwen2.5vl_merger` mmproj, following llama.cpp's
    converter (conversion/qwenvl.py Qwen2VLVisionModel): q, k and v split, the patch
    convolution split into its two frames, the window pattern as n_wa_pattern. The
    processor's pixel bounds are written too (clip.vision.image_min/max_pixels)."""
    raw = json.loads((directory / "config.json").read_text())
    vision = raw["vision_config"]
    processor = image_processor()
    writer = gguf.GGUFWriter(path, "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_file_type(
        gguf.LlamaFileType.ALL_F32 if qtype == "F32" else gguf.LlamaFileType.MOSTLY_Q8_0
    )
    writer.add_clip_has_vision_encoder(True)
    writer.add_vision_projection_dim(vision["out_hidden_size"])
    writer.add_vision_image_size(560)
    writer.add_vision_patch_size(vision["patch_size"])
    writer.add_vision_embedding_length(vision["hidden_size"])
    writer.add_vision_feed_forward_length(vision["intermediate_size"])
    writer.add_vision_block_count(vision["depth"])
    writer.add_vision_head_count(vision["num_heads"])
    writer.add_vision_image_mean(list(processor.image_mean))
    writer.add_vision_image_std(list(processor.image_std))
    writer.add_clip_projector_type(gguf.VisionProjectorType.QWEN25VL)
    writer.add_vision_use_silu(True)
    writer.add_vision_n_wa_pattern(vision["fullatt_block_indexes"][0] + 1)
    writer.add_vision_attention_layernorm_eps(1e-6)
    writer.add_vision_min_pixels(MIN_PIXELS)
    writer.add_vision_max_pixels(MAX_PIXELS)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision["depth"])

    def add(name: str, value: torch.Tensor) -> None:
        array = value.float().numpy()
        if qtype == "F32" or array.ndim != 2:
            writer.add_tensor(name, array)
        else:
            kind = gguf.GGMLQuantizationType[qtype]
            writer.add_tensor(name, quantize(array, kind), raw_dtype=kind)

    for name, value in load_file(str(directory / "model.safetensors")).items():
        if not name.startswith("visual."):
            continue
        if "patch_embed.proj.weight" in name:  # [out, C, 2, p, p]: one Conv2D per frame
            patch = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.V_ENC_EMBD_PATCH]
            writer.add_tensor(f"{patch}.weight", value[:, :, 0].float().numpy())
            writer.add_tensor(f"{patch}.weight.1", value[:, :, 1].float().numpy())
            continue
        parts = [(name, value)]
        if ".qkv." in name:
            parts = [
                (name.replace("qkv", p), v) for p, v in zip("qkv", value.chunk(3), strict=True)
            ]
        for part, tensor in parts:
            gguf_name = names.get_name(part, try_suffixes=(".weight", ".bias"))
            assert gguf_name is not None, part
            add(gguf_name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
