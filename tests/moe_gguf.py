"""A tiny Qwen3-MoE Hugging Face checkpoint written as GGUF the way llama.cpp's converter
writes `qwen3moe` files: its tensor names (experts as 3-D [experts, out, in] tensors) and
metadata keys, the donor's tokenizer fields."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from safetensors.torch import load_file
from synthetic_files import synthetic_gguf

_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate": "ffn_gate_inp",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_EXPERTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


def write_moe_gguf(directory: Path, path: Path, qtype: GGMLQuantizationType) -> Path:
    """The checkpoint in `directory` as a `qwen3moe` GGUF at `path`: matrices in `qtype`
    (F32 or Q8_0), norms and the router in F32, as llama.cpp keeps them."""
    config = json.loads((directory / "config.json").read_text())
    state = load_file(str(directory / "model.safetensors"))
    tensors: dict[str, torch.Tensor] = {"token_embd.weight": state["model.embed_tokens.weight"]}
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        for ours, theirs in _LAYER.items():
            if f"{prefix}{ours}.weight" in state:
                tensors[f"blk.{layer}.{theirs}.weight"] = state[f"{prefix}{ours}.weight"]
        experts = config["num_local_experts"]
        for part, name in _EXPERTS.items():
            key = f"{prefix}mlp.experts.{{}}.{part}.weight"
            if key.format(0) in state:
                stacked = torch.stack([state[key.format(e)] for e in range(experts)])
                tensors[f"blk.{layer}.{name}.weight"] = stacked
    tensors["output_norm.weight"] = state["model.norm.weight"]

    writer = GGUFWriter(path, "qwen3moe")
    writer.add_type("model")
    writer.add_name("tiny qwen3moe")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_expert_count(config["num_local_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    for field in synthetic_gguf.tokenizer_fields():
        sub_type = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(field.key, field.value, field.types[0], sub_type=sub_type)
    for name, tensor in tensors.items():
        values = tensor.float().numpy()
        keep_f32 = values.ndim == 1 or "ffn_gate_inp" in name
        if keep_f32 or qtype == GGMLQuantizationType.F32:
            writer.add_tensor(name, values)
        else:
            writer.add_tensor(name, quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
