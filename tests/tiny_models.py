"""Tiny Hugging Face checkpoints with random weights and a real tokenizer, made by tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

from modelhost.models.loaded import LoadedModel

SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)
ARCHITECTURES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {}),
    "gemma3": (
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        dict(
            sliding_window=8,
            query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
    ),
    # Eight experts, two a token, the middle layer dense: routing, renormalised weights and
    # the dense/sparse layer mix all show; positions past the long parity prompt (~700 tokens).
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            max_position_embeddings=1024,
        ),
    ),
}


def make_tiny_checkpoint(directory: Path, architecture: str, donor: LoadedModel) -> Path:
    """Write config.json, model.safetensors and the donor's tokenizer files into `directory`."""
    config_class, model_class, extra = ARCHITECTURES[architecture]
    vocab = donor.tokenizer.vocab_size
    config = config_class(
        vocab_size=vocab,
        tie_word_embeddings=True,
        bos_token_id=donor.tokenizer.bos_token_id,
        eos_token_id=sorted(donor.tokenizer.eos_token_ids)[0],
        **{**SHAPE, **{k: v for k, v in extra.items() if v is not None}},
    )
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():  # random norms, so a (1 + w) mistake cannot hide behind w == 0
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(-0.5, 0.5)
    model.save_pretrained(directory)
    donor.tokenizer.backend.save(str(directory / "tokenizer.json"))
    settings = {
        "bos_token": donor.tokenizer.bos_token,
        "eos_token": donor.tokenizer.eos_token,
        "chat_template": donor.tokenizer.chat_template,
        "add_bos_token": False,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    return directory


def reference_model(directory: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager"
    ).eval()
