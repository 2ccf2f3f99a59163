"""A tiny Qwen2.5-VL checkpoint (random weights; the donor's real byte-level BPE tokenizer, which
has ChatML's <|im_start|> and <|im_end|>, with Qwen's vision tokens added), made with
transformers' own classes, and transformers' processor and model for it."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from PIL import Image
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
