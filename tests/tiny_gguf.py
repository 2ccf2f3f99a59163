"""A tiny Hugging Face checkpoint (tests/tiny_models.py) written again as GGUF, the way
llama.cpp's converter writes that family: its tensor names (gguf's own name map), its metadata
keys, its q/k row interleaving, Gemma's (1 + w) norms stored as such, and the rotary tensors
it adds (Llama 3.1's rope_freqs, Phi-3's longrope factors), a mixture of experts' per-expert
weights stacked into one 3-D tensor each and its router kept in F32. Written here from llama.cpp's
conversion rules, not from modelhost's loader, so the loader is checked against them."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf.quants import quantize
from safetensors.torch import load_file
from synthetic_files import synthetic_gguf

# Hugging Face model_type -> the GGUF architecture llama.cpp writes it as.
GGUF_ARCHITECTURES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "smollm3": "smollm3",
    "granite": "granite",
    "qwen3_moe": "qwen3moe",
    "qwen2_5_vl_text": "qwen2vl",  # Qwen2.5-VL's text model (M-RoPE)
}
PERMUTED = ("llama", "smollm3", "granite")  # LlamaModel's subclasses in the converter
GEMMA = ("gemma2", "gemma3")


def write_gguf_from_hf(
    directory: Path,
    path: Path,
    qtype: str = "F32",
    added_tokens: Sequence[str] = (),
    chat_template: str | None = None,
    pooling_type: int | None = None,
    appended_eos: int | None = None,
    rank_head: tuple[int, int] | None = None,
    pre_tokenizer: str | None = None,
) -> Path:
    """`directory`'s checkpoint as a GGUF at `path`, 2-D weights in `qtype` (F32 or Q8_0);
    `added_tokens` follow the donor's vocabulary as control tokens (a checkpoint whose
    tokenizer added them, as SmolVLM's image tokens); `chat_template` in place of the
    donor's ("" for none); `pooling_type`, an embedder's `<arch>.pooling_type`; `appended_eos`,
    an EOS id the tokenizer appends to every text (`tokenizer.ggml.add_eos_token`), as the
    converter writes a tokenizer whose post-processor appends one (Qwen3-Embedding's). A
    checkpoint saved from a base model (no `model.` prefix) is read as its causal LM's.
    `rank_head` (the ids of "yes" and "no"): a Qwen3-Reranker as llama.cpp's converter writes
    one, rank pooling and a `cls.output` head of the LM head's yes and no rows.
    `pre_tokenizer`: `tokenizer.ggml.pre` in place of the donor's (a real Qwen3 file's "qwen2")."""
    raw = json.loads((directory / "config.json").read_text())
    arch = GGUF_ARCHITECTURES[raw["model_type"]]
    writer = gguf.GGUFWriter(path, arch)
    _metadata(writer, raw, arch, added_tokens, chat_template, appended_eos, pre_tokenizer)
    if pooling_type is not None:
        writer.add_pooling_type(gguf.PoolingType(pooling_type))
    if rank_head is not None:
        writer.add_pooling_type(gguf.PoolingType.RANK)
        writer.add_classifier_output_labels(["yes", "no"])
    names = gguf.get_tensor_name_map(_arch_enum(arch), raw["num_hidden_layers"])
    # llama.cpp's qwen3moe has no dense layers; a checkpoint's (mlp_only_layers) keep qwen3's
    dense_names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, raw["num_hidden_layers"])
    saved = load_file(str(directory / "model.safetensors"))
    saved = {
        k if k.startswith(("model.", "lm_head.")) else f"model.{k}": v for k, v in saved.items()
    }
    tensors = _experts_stacked(saved)
    if rank_head is not None:
        head = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])
        writer.add_tensor("cls.output.weight", head[list(rank_head)].float().numpy())
    for name, tensor in tensors.items():
        if name == "lm_head.weight" and raw.get("tie_word_embeddings"):
            continue
        value = _converted(name, tensor.float(), raw, arch)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        gguf_name = gguf_name or dense_names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        _add(writer, gguf_name, value.numpy(), qtype)
    for gguf_name, values in _rotary_tensors(raw):
        writer.add_tensor(gguf_name, np.asarray(values, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _experts_stacked(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert weights (`mlp.experts.N.gate_proj.weight`) stacked by expert into one
    [experts, out, in] tensor each (`mlp.experts.gate_proj.weight`), as the converter does."""
    stacked: dict[str, dict[int, torch.Tensor]] = {}
    kept: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        match = _EXPERT.match(name)
        if match is None:
            kept[name] = tensor
            continue
        prefix, expert, part = match.groups()
        stacked.setdefault(f"{prefix}.experts.{part}", {})[int(expert)] = tensor
    for name, by_expert in stacked.items():
        kept[name] = torch.stack([by_expert[e] for e in sorted(by_expert)])
    return kept


_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp)\.experts\.(\d+)\.(\w+_proj\.weight)$")


def _arch_enum(arch: str) -> gguf.MODEL_ARCH:
    return next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == arch)


def _metadata(
    writer: gguf.GGUFWriter,
    raw: dict[str, Any],
    arch: str,
    added_tokens: Sequence[str] = (),
    chat_template: str | None = None,
    appended_eos: int | None = None,
    pre_tokenizer: str | None = None,
) -> None:
    heads = raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    rope = _rope(raw)
    writer.add_context_length(raw["max_position_embeddings"])
    writer.add_embedding_length(raw["hidden_size"])
    writer.add_block_count(raw["num_hidden_layers"])
    writer.add_feed_forward_length(raw["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(raw["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(raw["rms_norm_eps"])
    writer.add_rope_freq_base(rope.get("rope_theta") or raw.get("rope_theta") or 10_000.0)
    partial = rope.get("partial_rotary_factor") or raw.get("partial_rotary_factor") or 1.0
    writer.add_rope_dimension_count(int(partial * raw["hidden_size"]) // heads)
    writer.add_vocab_size(raw["vocab_size"])
    if rope.get("mrope_section"):  # llama.cpp pads the three sections to four
        writer.add_rope_dimension_sections([*rope["mrope_section"], 0])
    if raw.get("sliding_window") and raw.get("use_sliding_window") is not False:
        writer.add_sliding_window(raw["sliding_window"])
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(raw["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(raw["final_logit_softcapping"])
    if arch == "phi3":
        writer.add_rope_scaling_orig_ctx_len(raw["original_max_position_embeddings"])
        scale = raw["max_position_embeddings"] / raw["original_max_position_embeddings"]
        attn = math.sqrt(1 + math.log(scale) / math.log(raw["original_max_position_embeddings"]))
        writer.add_rope_scaling_attn_factors(attn if scale > 1 else 1.0)
    experts = raw.get("num_experts") or raw.get("num_local_experts")
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(raw["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(raw["moe_intermediate_size"])
    if arch == "granite":
        writer.add_attention_scale(raw["attention_multiplier"])
        writer.add_embedding_scale(raw["embedding_multiplier"])
        writer.add_residual_scale(raw["residual_multiplier"])
        writer.add_logit_scale(raw["logits_scaling"])
    for field in synthetic_gguf.tokenizer_fields():  # the donor's (SmolLM2's) tokenizer
        sub_type = field.types[1] if len(field.types) > 1 else None
        value = field.value
        if field.key == "tokenizer.ggml.tokens":
            value = [*value, *added_tokens]
        elif field.key == "tokenizer.ggml.token_type":
            value = [*value, *[gguf.TokenType.CONTROL] * len(added_tokens)]
        elif field.key == "tokenizer.chat_template" and chat_template is not None:
            if not chat_template:  # "": the file carries no template (the family's is used)
                continue
            value = chat_template
        elif field.key == "tokenizer.ggml.eos_token_id" and appended_eos is not None:
            value = appended_eos
        elif field.key == "tokenizer.ggml.pre" and pre_tokenizer is not None:
            value = pre_tokenizer
        writer.add_key_value(field.key, value, field.types[0], sub_type=sub_type)
    if appended_eos is not None:
        writer.add_add_eos_token(True)


def _converted(name: str, value: torch.Tensor, raw: dict[str, Any], arch: str) -> torch.Tensor:
    if arch in PERMUTED and name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = raw["num_attention_heads"] if "q_proj" in name else raw["num_key_value_heads"]
        shape = value.shape
        value = value.reshape(heads, 2, shape[0] // heads // 2, *shape[1:])
        value = value.swapaxes(1, 2).reshape(shape)
    if arch in GEMMA and name.endswith("norm.weight"):
        value = value + 1
    return value


def _rope(raw: dict[str, Any]) -> dict[str, Any]:
    """The global layers' rotary settings (Gemma 3 keeps one set per attention kind)."""
    rope = {**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}
    return rope.get("full_attention", rope)


def _rotary_tensors(raw: dict[str, Any]) -> list[tuple[str, list[float]]]:
    rope = _rope(raw)
    kind = rope.get("rope_type") or rope.get("type")
    if kind == "llama3":
        heads = raw["num_attention_heads"]
        dim = raw.get("head_dim") or raw["hidden_size"] // heads
        base = rope.get("rope_theta") or raw.get("rope_theta")
        freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        original = rope["original_max_position_embeddings"]
        low, high, factor = rope["low_freq_factor"], rope["high_freq_factor"], rope["factor"]
        factors = []
        for freq in freqs.tolist():
            wavelength = 2 * math.pi / freq
            if wavelength < original / high:
                factors.append(1.0)
            elif wavelength > original / low:
                factors.append(factor)
            else:
                smooth = (original / wavelength - low) / (high - low)
                factors.append(1 / ((1 - smooth) / factor + smooth))
        return [("rope_freqs.weight", factors)]
    if kind == "longrope":
        return [
            ("rope_factors_long.weight", rope["long_factor"]),
            ("rope_factors_short.weight", rope["short_factor"]),
        ]
    return []


def _add(writer: gguf.GGUFWriter, name: str, value: np.ndarray, qtype: str) -> None:
    if qtype == "F32" or value.ndim == 1 or "ffn_gate_inp" in name:  # norms, routers
        writer.add_tensor(name, value.astype(np.float32))
        return
    kind = gguf.GGMLQuantizationType[qtype]
    writer.add_tensor(name, quantize(value.astype(np.float32), kind), raw_dtype=kind)


def write_gguf_lora_from_peft(
    adapter: Path, base: Path, path: Path, architecture: str | None = None
) -> Path:
    """A PEFT adapter folder of `base` written again as llama.cpp's convert_lora_to_gguf.py
    writes it: general.type adapter, adapter.type lora, adapter.lora.alpha, tensors
    `blk.N.<part>.weight.lora_a` / `.lora_b`, B's q/k rows interleaved as the base's are;
    general.architecture the base's, or `architecture` (an adapter claiming another model)."""
    raw = json.loads((base / "config.json").read_text())
    config = json.loads((adapter / "adapter_config.json").read_text())
    arch = GGUF_ARCHITECTURES[raw["model_type"]]
    writer = gguf.GGUFWriter(path, architecture or arch)
    writer.add_string(gguf.Keys.General.TYPE, gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(config["lora_alpha"]))
    names = gguf.get_tensor_name_map(_arch_enum(arch), raw["num_hidden_layers"])
    for name, tensor in load_file(str(adapter / "adapter_model.safetensors")).items():
        stem, _, part = name.removeprefix("base_model.model.").rpartition(".lora_")
        gguf_name = names.get_name(f"{stem}.weight", try_suffixes=(".weight",))
        assert gguf_name is not None, name
        value = tensor.float()
        if part == "B.weight":
            value = _converted(f"{stem}.weight", value, raw, arch)
        suffix = ".lora_a" if part == "A.weight" else ".lora_b"
        writer.add_tensor(gguf_name + suffix, value.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
