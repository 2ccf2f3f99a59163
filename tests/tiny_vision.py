"""A tiny SmolVLM checkpoint (random weights, the donor's real tokenizer with the image tokens
added), made with transformers' own classes, and transformers' processor and model for it."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
import transformers
from gguf.quants import quantize
from safetensors.torch import load_file, save_file
from tiny_gguf import write_gguf_from_hf
from tiny_models import SHAPE
from tokenizers import Tokenizer as TokenizerBackend

from modelhost.models.loaded import LoadedModel

IMAGE_TOKENS = [
    "<fake_token_around_image>",
    "<image>",
    "<global-img>",
    "<end_of_utterance>",
    *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)),
]
VISION = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    image_size=64,
    patch_size=16,
    layer_norm_eps=1e-6,
)
TILE = 64  # max_image_size: one tile is the encoder's image
LONGEST_EDGE = 4 * TILE  # size: the whole image's longest edge
SCALE_FACTOR = 2
IMAGE_SEQ_LEN = (TILE // 16) ** 2 // SCALE_FACTOR**2


def image_processor_settings() -> dict[str, object]:
    return dict(
        size={"longest_edge": LONGEST_EDGE},
        max_image_size={"longest_edge": TILE},
        do_image_splitting=True,
        image_mean=[0.5, 0.4, 0.3],
        image_std=[0.2, 0.3, 0.25],
        resample=1,
    )


def make_tiny_smolvlm(directory: Path, donor: LoadedModel) -> Path:
    """config.json, model.safetensors, tokenizer files and the processor's configs."""
    directory.mkdir(parents=True, exist_ok=True)
    backend = TokenizerBackend.from_str(donor.tokenizer.backend.to_str())
    backend.add_special_tokens(IMAGE_TOKENS)
    backend.save(str(directory / "tokenizer.json"))
    vocab = backend.get_vocab_size(with_added_tokens=True)
    config = transformers.SmolVLMConfig(
        vision_config=dict(VISION, initializer_range=0.2),
        text_config=dict(
            SHAPE,
            model_type="llama",
            vocab_size=vocab,
            initializer_range=0.3,
            max_position_embeddings=1024,
            bos_token_id=donor.tokenizer.bos_token_id,
            eos_token_id=backend.token_to_id("<end_of_utterance>"),
        ),
        scale_factor=SCALE_FACTOR,
        image_token_id=backend.token_to_id("<image>"),
    )
    torch.manual_seed(0)
    model = transformers.SmolVLMForConditionalGeneration(config).eval()
    with torch.no_grad():  # random norms, so a norm's weight or bias cannot hide behind 1 or 0
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(-0.5, 0.5) if name.endswith("bias") else param.uniform_(0.5, 1.5)
            if "position_embedding" in name:
                param.normal_(0, 0.5)
    model.save_pretrained(directory)
    settings = {
        "bos_token": donor.tokenizer.bos_token,
        "eos_token": "<end_of_utterance>",
        "add_bos_token": False,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    processor = transformers.Idefics3ImageProcessorPil(**image_processor_settings())
    processor.save_pretrained(directory)
    (directory / "processor_config.json").write_text(json.dumps({"image_seq_len": IMAGE_SEQ_LEN}))
    return directory


def reference_processor(directory: Path) -> transformers.Idefics3Processor:
    """transformers' processor (Idefics3's: SmolVLM's builds the same prompt, but needs a video
    processor and num2words) over the checkpoint's tokenizer."""
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(directory / "tokenizer.json"), bos_token=None, eos_token=None
    )
    images = transformers.Idefics3ImageProcessorPil(**image_processor_settings())
    return transformers.Idefics3Processor(images, tokenizer, image_seq_len=IMAGE_SEQ_LEN)


def reference_smolvlm(directory: Path) -> torch.nn.Module:
    return transformers.SmolVLMForConditionalGeneration.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def write_smolvlm_gguf(directory: Path, out: Path, qtype: str = "F32") -> Path:
    """The checkpoint as llama.cpp's converter writes it: the text model as a `llama` GGUF
    (the image tokens in its vocabulary) and the vision tower as `mmproj-<name>.gguf` beside
    it, in a folder `out`. Returns the text model's path."""
    out.mkdir(parents=True, exist_ok=True)
    raw = json.loads((directory / "config.json").read_text())
    text_dir = out.parent / f"{out.name}-text-checkpoint"  # not in `out`: no model of its own
    text_dir.mkdir(exist_ok=True)
    text_config = {**raw["text_config"], "model_type": "llama", "tie_word_embeddings": False}
    (text_dir / "config.json").write_text(json.dumps(text_config))
    tensors = load_file(str(directory / "model.safetensors"))
    text = {
        name.replace("model.text_model.", "model."): value
        for name, value in tensors.items()
        if name.startswith(("model.text_model.", "lm_head."))
    }
    save_file(text, str(text_dir / "model.safetensors"))
    model_path = write_gguf_from_hf(text_dir, out / "tiny-smolvlm.gguf", qtype, IMAGE_TOKENS)
    write_mmproj(directory, out / "mmproj-tiny-smolvlm.gguf", qtype)
    return model_path


def write_mmproj(directory: Path, path: Path, qtype: str = "F32") -> Path:
    """The vision tower and connector as an `mmproj` GGUF, following llama.cpp's converter
    (conversion/base.py MmprojModel, conversion/smolvlm.py): `clip` architecture, clip.vision.*
    hyper-parameters, gguf's MMPROJ tensor names, embeddings kept in F32; `qtype` F32, F16 or
    Q8_0 for the other weights."""
    raw = json.loads((directory / "config.json").read_text())
    vision = raw["vision_config"]
    processor = json.loads((directory / "preprocessor_config.json").read_text())
    writer = gguf.GGUFWriter(path, "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    file_types = {"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16}
    writer.add_file_type(file_types.get(qtype, gguf.LlamaFileType.MOSTLY_Q8_0))
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
    writer.add_clip_projector_type(gguf.VisionProjectorType.IDEFICS3)
    writer.add_vision_attention_layernorm_eps(vision.get("layer_norm_eps", 1e-5))
    writer.add_vision_projector_scale_factor(raw.get("scale_factor", 2))
    writer.add_vision_use_gelu(True)
    writer.add_vision_preproc_image_size(processor["size"]["longest_edge"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision["num_hidden_layers"])
    for name, value in load_file(str(directory / "model.safetensors")).items():
        if not name.startswith(("model.vision_model.", "model.connector.")):
            continue
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        array = value.float().numpy()
        if qtype == "F32" or array.ndim == 1 or ".embeddings." in name:
            writer.add_tensor(gguf_name, array)
        elif qtype == "F16" or array.shape[-1] % 32:  # F16, or Q8_0's fallback where blocks
            # of 32 do not tile a row
            writer.add_tensor(gguf_name, array.astype(np.float16))
        else:
            kind = gguf.GGMLQuantizationType[qtype]
            writer.add_tensor(gguf_name, quantize(array, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
