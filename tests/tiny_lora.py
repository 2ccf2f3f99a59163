"""Tiny PEFT LoRA adapters over a tiny checkpoint (tests/tiny_models.py), made with `peft`,
and the merged model PEFT makes of each: what the adapter tests compare against."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from tiny_models import reference_model

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_peft_adapter(
    base: Path,
    directory: Path,
    *,
    seed: int,
    targets: tuple[str, ...] = ALL_LINEAR,
    rank: int = 4,
    alpha: float = 8.0,
) -> torch.nn.Module:
    """Save an adapter of `base` (random A and B, so it changes the answers) into `directory`;
    returns PEFT's merged model of it, in fp32."""
    model = reference_model(base)
    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False
    )
    torch.manual_seed(seed)
    # peft reads a transformers attribute it deprecates, and warns of a tied LM head
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", UserWarning)
        adapted = get_peft_model(model, config)
        with torch.no_grad():  # larger than PEFT's init, so every adapter moves greedy tokens
            for name, param in adapted.named_parameters():
                if "lora_B" in name:
                    param.mul_(4.0)
        adapted.save_pretrained(directory)  # (and of saving the embeddings an adapter trains)
        return adapted.merge_and_unload().eval()
