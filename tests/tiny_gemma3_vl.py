"""A tiny Gemma 3 vision checkpoint (random weights, made with transformers' own classes; the
donor's real tokenizer with Gemma's turn and image tokens added), transformers' model for it,
and the checkpoint written again as llama.cpp's converter writes a Gemma 3 vision model: a
`gemma3` text GGUF and an mmproj with projector `gemma3` beside it."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
import transformers
from family_templates import template
from safetensors.torch import load_file, save_file
from tiny_gguf import write_gguf_from_hf
from tokenizers import Tokenizer as TokenizerBackend

from modelhost.models.loaded import LoadedModel

GEMMA_TOKENS = [
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
]
IMAGE = 64  # the tower's square image
TOKENS_PER_IMAGE = 4  # (64 / 16)² patches pooled 2 x 2
PROCESSOR = dict(size={"height": IMAGE, "width": IMAGE}, image_mean=[0.5, 0.4, 0.3])

# Gemma 3 4B's own chat template, which llama.cpp's converter copies into the GGUF: an image
# part is <start_of_image>.
GEMMA3_CHAT_TEMPLATE = template("gemma3_vision")


def make_tiny_gemma3_vl(directory: Path, donor: LoadedModel) -> Path:
    """config.json, model.safetensors, tokenizer files (Gemma 3's chat template) and the image
    processor's config."""
    directory.mkdir(parents=True, exist_ok=True)
    backend = TokenizerBackend.from_str(donor.tokenizer.backend.to_str())
    backend.add_special_tokens(GEMMA_TOKENS)
    backend.save(str(directory / "tokenizer.json"))
    token = backend.token_to_id
    config = transformers.Gemma3Config(
        text_config=dict(
            vocab_size=backend.get_vocab_size(with_added_tokens=True),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            # llama.cpp scales scores by 1/sqrt(head_dim) for every Gemma 3 but 27B, as the
            # real 4B's 256 = head_dim does
            query_pre_attn_scalar=16,
            max_position_embeddings=1024,
            initializer_range=0.3,
            bos_token_id=donor.tokenizer.bos_token_id,
            eos_token_id=token("<end_of_turn>"),
            tie_word_embeddings=False,  # as the wrapper's, below
        ),
        vision_config=dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=IMAGE,
            patch_size=16,
            initializer_range=0.2,
        ),
        mm_tokens_per_image=TOKENS_PER_IMAGE,
        image_token_index=token("<image_soft_token>"),
        boi_token_index=token("<start_of_image>"),
        eoi_token_index=token("<end_of_image>"),
        # untied (the real model ties them): a random model with tied embeddings repeats its
        # last token whatever the image
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # random norms and projection, so none hides behind 0 or 1
        for name, param in model.named_parameters():
            if "norm" in name or "mm_input_projection" in name:
                param.uniform_(-0.5, 0.5)
    model.save_pretrained(directory)
    settings = {
        "bos_token": donor.tokenizer.bos_token,
        "eos_token": "<end_of_turn>",
        "add_bos_token": False,
        "chat_template": GEMMA3_CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    transformers.Gemma3ImageProcessorPil(**PROCESSOR).save_pretrained(directory)
    return directory


def reference_gemma3(directory: Path) -> torch.nn.Module:
    return transformers.Gemma3ForConditionalGeneration.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def reference_pixels(image: object) -> torch.Tensor:
    processor = transformers.Gemma3ImageProcessorPil(**PROCESSOR)
    return processor(images=[image], return_tensors="pt")["pixel_values"]


def write_gemma3_vl_gguf(
    directory: Path, out: Path, qtype: str = "F32", chat_template: str | None = None
) -> Path:
    """The checkpoint as llama.cpp's converter writes it (conversion/gemma.py Gemma3Model and
    Gemma3VisionModel): the text model as a `gemma3` GGUF (norms as 1 + w, Gemma's tokens in its
    vocabulary, `chat_template` in it; "" for none) and the tower as `mmproj-<name>.gguf`
    beside it, in a folder `out`. Returns the text model's path."""
    out.mkdir(parents=True, exist_ok=True)
    raw = json.loads((directory / "config.json").read_text())
    text_dir = out.parent / f"{out.name}-text-checkpoint"  # not in `out`: no model of its own
    text_dir.mkdir(exist_ok=True)
    text_config = {**raw["text_config"], "model_type": "gemma3_text", "tie_word_embeddings": False}
    (text_dir / "config.json").write_text(json.dumps(text_config))
    # transformers saves Gemma 3 in its older layout: language_model.model.*,
    # language_model.lm_head.*, vision_tower.*
    text = {
        name.removeprefix("language_model."): value
        for name, value in load_file(str(directory / "model.safetensors")).items()
        if name.startswith("language_model.")
    }
    save_file(text, str(text_dir / "model.safetensors"))
    model_path = write_gguf_from_hf(
        text_dir, out / "tiny-gemma3-vl.gguf", qtype, GEMMA_TOKENS, chat_template
    )
    write_gemma3_mmproj(directory, out / "mmproj-tiny-gemma3-vl.gguf")
    return model_path


def write_gemma3_mmproj(directory: Path, path: Path) -> Path:
    """The checkpoint's tower as llama.cpp's converter writes a Gemma 3 mmproj
    (conversion/gemma.py Gemma3VisionModel): projector `gemma3`, gguf's MMPROJ names, the
    projection as stored (F16), the soft-token norm as 1 + w, embeddings in F32."""
    raw = json.loads((directory / "config.json").read_text())
    vision = raw["vision_config"]
    processor = json.loads((directory / "preprocessor_config.json").read_text())
    writer = gguf.GGUFWriter(path, "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_clip_has_vision_encoder(True)
    writer.add_vision_projection_dim(raw["text_config"]["hidden_size"])
    writer.add_vision_image_size(vision["image_size"])
    writer.add_vision_patch_size(vision["patch_size"])
    writer.add_vision_embedding_length(vision["hidden_size"])
    writer.add_vision_feed_forward_length(vision["intermediate_size"])
    writer.add_vision_block_count(vision["num_hidden_layers"])
    writer.add_vision_head_count(vision["num_attention_heads"])
    writer.add_vision_image_mean(processor["image_mean"])
    writer.add_vision_image_std(processor["image_std"])
    writer.add_clip_projector_type(gguf.VisionProjectorType.GEMMA3)
    writer.add_vision_attention_layernorm_eps(vision.get("layer_norm_eps", 1e-6))
    writer.add_vision_use_gelu(True)
    side = vision["image_size"] // vision["patch_size"]
    writer.add_vision_projector_scale_factor(side // int(raw["mm_tokens_per_image"] ** 0.5))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision["num_hidden_layers"])
    for file in sorted(directory.glob("*.safetensors")):
        for name, value in load_file(str(file)).items():
            if not name.startswith(("vision_tower.", "multi_modal_projector.")) or ".head." in name:
                continue
            if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_"):
                name = name.replace("vision_tower.", "vision_tower.vision_model.", 1)
            name = name.replace("_weight", ".weight")
            array = value.float().numpy()
            if "soft_emb_norm" in name:
                array = array + 1
            gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
            assert gguf_name is not None, name
            if "input_projection" in name:
                array = array.astype(np.float16)
            writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
