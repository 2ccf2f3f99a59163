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
    # Llama 3.1's rotary scaling, its context shrunk so a tiny head's frequencies fall in all
    # three of its bands (kept, slowed, blended).
    "llama3": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
            rope_theta=500_000.0,
        ),
    ),
    "mistral": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        dict(sliding_window=32),  # every layer; the long prompts pass it
    ),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {}),
    # Phi-4-mini's shape of rotary: three quarters of each head, longrope's short factors and
    # attention factor (a context 8 times the original).
    "phi3": (
        transformers.Phi3Config,
        transformers.Phi3ForCausalLM,
        dict(
            partial_rotary_factor=0.75,
            max_position_embeddings=1024,
            original_max_position_embeddings=128,
            rope_scaling=dict(
                rope_type="longrope",
                short_factor=[1.0, 1.1, 1.3, 1.8, 2.5, 4.0],
                long_factor=[1.0, 2.0, 4.0, 8.0, 16.0, 32.0],
            ),
            pad_token_id=None,
        ),
    ),
    "gemma2": (
        transformers.Gemma2Config,
        transformers.Gemma2ForCausalLM,
        dict(
            sliding_window=32,
            query_pre_attn_scalar=16,
            attn_logit_softcapping=3.0,  # small enough that the cap bends tiny models' scores
            final_logit_softcapping=2.0,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
    ),
    "gemma3": (
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        # Gemma 3's pattern (five sliding layers, then a global one), which GGUF files keep
        # only as llama.cpp's rule for the architecture.
        dict(
            num_hidden_layers=6,
            sliding_window=8,
            query_pre_attn_scalar=16,
            layer_types=["sliding_attention"] * 5 + ["full_attention"],
        ),
    ),
    # Every fourth layer without rotary: four layers.
    "smollm3": (
        transformers.SmolLM3Config,
        transformers.SmolLM3ForCausalLM,
        dict(num_hidden_layers=4, no_rope_layer_interval=4, pad_token_id=None),
    ),
    "granite": (
        transformers.GraniteConfig,
        transformers.GraniteForCausalLM,
        dict(
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=0.1,
            logits_scaling=8.0,
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


def make_tiny_checkpoint(
    directory: Path, architecture: str, donor: LoadedModel, **overrides: object
) -> Path:
    """Write config.json, model.safetensors and the donor's tokenizer files into `directory`;
    `overrides` replace fields of the shape (say, a longer context)."""
    config_class, model_class, extra = ARCHITECTURES[architecture]
    vocab = donor.tokenizer.vocab_size
    fields = {**SHAPE, **overrides, **extra}
    config = config_class(
        vocab_size=vocab,
        tie_word_embeddings=True,
        bos_token_id=donor.tokenizer.bos_token_id,
        eos_token_id=sorted(donor.tokenizer.eos_token_ids)[0],
        **fields,
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
