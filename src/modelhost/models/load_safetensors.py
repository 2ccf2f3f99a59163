"""Hugging Face directories: config.json, *.safetensors, generation_config.json."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from modelhost.models import packed
from modelhost.models.config import ModelConfig


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
    if "text_config" in raw:  # multimodal wrappers keep the language model's config inside
        raw = {**raw["text_config"], "model_type": raw["text_config"].get("model_type", "")}
    model_type = str(raw.get("model_type", "llama"))
    gemma = model_type.startswith("gemma3")
    hidden = int(raw["hidden_size"])
    num_heads = int(raw["num_attention_heads"])
    head_dim = int(raw.get("head_dim") or hidden // num_heads)
    rope = raw.get("rope_parameters") or {}
    if gemma and isinstance(rope.get("full_attention"), dict):
        local = rope.get("sliding_attention") or {}
        rope, local_theta = rope["full_attention"], local.get("rope_theta")
    else:
        local_theta = None
    scaling = raw.get("rope_scaling") or rope
    factor = scaling.get("factor") if scaling.get("rope_type", "linear") == "linear" else None
    fields: dict[str, Any] = dict(
        architecture="gemma3" if gemma else "llama",
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(raw.get("rope_theta") or rope.get("rope_theta") or 10_000.0),
        context_length=int(raw.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", gemma)),
        rope_scaling_factor=float(factor or 1.0),
        attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
        qk_norm=gemma or model_type == "qwen3",
    )
    if gemma:
        layer_types = raw.get("layer_types")
        if layer_types:
            kinds = ("sliding" if kind == "sliding_attention" else "global" for kind in layer_types)
            fields["layer_kinds"] = tuple(kinds)
        fields.update(
            rope_local_theta=float(local_theta or raw.get("rope_local_base_freq", 10_000.0)),
            sliding_window=int(raw.get("sliding_window") or 512),
            sliding_window_pattern=int(raw.get("sliding_window_pattern") or 6),
            query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar") or head_dim),
            final_logit_softcapping=raw.get("final_logit_softcapping"),
            attn_logit_softcapping=raw.get("attn_logit_softcapping"),
        )
    return ModelConfig(**fields)


class SafetensorsTensor:
    """One tensor of a safetensors file, read when asked for (a models/weights.py
    TensorSource). Floats other than F32, F16 and BF16 are read as fp32."""

    def __init__(self, file: Path, key: str, name: str, gemma_norm: bool) -> None:
        self.file, self.key, self.name, self.stored_name = file, key, name, key
        self.gemma_norm = gemma_norm  # Gemma stores norms as w, applied as (1 + w)
        with safe_open(str(file), framework="pt") as handle:
            tensor_slice = handle.get_slice(key)
            self.shape = tuple(tensor_slice.get_shape())
            dtype = tensor_slice.get_dtype()
        self.type = _TYPES.get(dtype, packed.F32)
        self.order: torch.Tensor | None = None
        self.nbytes = math.prod(self.shape) * _SIZES.get(dtype, 4)

    def _read(self) -> torch.Tensor:
        with safe_open(str(self.file), framework="pt") as handle:
            return handle.get_tensor(self.key)

    def dense(self) -> torch.Tensor:
        value = self._read().to(torch.float32)
        return value + 1.0 if self.gemma_norm else value

    @contextlib.contextmanager
    def stored(self) -> Iterator[int]:
        value = self._read()
        if value.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            value = value.to(torch.float32)
        value = value.contiguous()  # alive until the block ends
        yield value.data_ptr()


_TYPES = {"F32": packed.F32, "F16": packed.F16, "BF16": packed.BF16}
_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1}


def safetensors_tensors(directory: Path, config: ModelConfig) -> dict[str, SafetensorsTensor]:
    """Every tensor of the directory's *.safetensors files, under our parameter names, unread."""
    found: dict[str, SafetensorsTensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            keys = list(handle.keys())
        for key in keys:
            name = key.removeprefix("model.language_model.").removeprefix("language_model.")
            if not name.startswith(("model.", "lm_head.")):
                name = "model." + name
            gemma_norm = config.architecture == "gemma3" and name.endswith("norm.weight")
            found[name] = SafetensorsTensor(file, key, name, gemma_norm)
    return found
