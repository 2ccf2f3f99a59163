"""GGUF: hyper-parameters from metadata, and each tensor read on its own from the file.

Tensors are read with plain file reads into one reused buffer, not through the reader's
memory map: a mapped page that has been read stays in the process's resident set, so a
loader touching every page of an 8 GB file would show 8 GB more than the model holds.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf.quants import dequantize

from modelhost.models import native
from modelhost.models.config import ModelConfig
from modelhost.models.packed import PackedWeight

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Llama places its MLP norm after attention; Gemma 3 has four norms per block.
_NORM_NAMES = {
    "llama": {"ffn_norm": "post_attention_layernorm"},
    "gemma3": {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


class GGUFFile:
    """An open GGUF file: its metadata fields and tensor table, parsed by `gguf`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.reader = gguf.GGUFReader(str(path))
        self.architecture: str = self.field("general.architecture")

    def field(self, key: str, default: Any = None) -> Any:
        f = self.reader.fields.get(key)
        if f is None:
            return default
        return f.contents()

    def arch_field(self, key: str, default: Any = None) -> Any:
        return self.field(f"{self.architecture}.{key}", default)

    def config(self) -> ModelConfig:
        arch = self.architecture
        hidden = int(self.arch_field("embedding_length"))
        num_heads = int(self.arch_field("attention.head_count"))
        head_dim = int(self.arch_field("attention.key_length", hidden // num_heads))
        tensor_names = {t.name for t in self.reader.tensors}
        vocab = self.arch_field("vocab_size") or len(self.field("tokenizer.ggml.tokens"))
        common: dict[str, Any] = dict(
            architecture="gemma3" if arch == "gemma3" else "llama",
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(self.arch_field("feed_forward_length")),
            num_layers=int(self.arch_field("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(self.arch_field("attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            rms_norm_eps=float(self.arch_field("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(self.arch_field("rope.freq_base", 10_000.0)),
            context_length=int(self.arch_field("context_length", 4096)),
            tie_word_embeddings="output.weight" not in tensor_names,
            rope_scaling_factor=float(self.arch_field("rope.scaling.factor", 1.0) or 1.0),
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        )
        if arch == "gemma3":
            common.update(
                sliding_window=int(self.arch_field("attention.sliding_window", 512)),
                query_pre_attn_scalar=float(head_dim),
                final_logit_softcapping=self.arch_field("final_logit_softcapping"),
                attn_logit_softcapping=self.arch_field("attn_logit_softcapping"),
            )
        return ModelConfig(**common)

    def tensor_table(self) -> list[dict[str, Any]]:
        """Each tensor's name, GGUF type, shape (the file's order), offset and size: all a
        later load needs to read it, without parsing the header again."""
        return [
            {
                "name": t.name,
                "type": int(t.tensor_type),
                "shape": [int(n) for n in t.shape],
                "offset": int(t.data_offset),
                "nbytes": int(t.n_bytes),
            }
            for t in self.reader.tensors
        ]


class FileReader:
    """Reads byte ranges of a file into one buffer that the next read reuses."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._buffer: np.ndarray | None = None

    def read(self, offset: int, size: int) -> np.ndarray:
        if self._buffer is None or self._buffer.size < size:
            self._buffer = np.empty(size, dtype=np.uint8)
        view = self._buffer[:size]
        with self.path.open("rb", buffering=0) as handle:
            handle.seek(offset)
            done = 0
            while done < size:
                count = handle.readinto(memoryview(view[done:]))
                if not count:
                    raise OSError(f"{self.path} ends inside tensor data at byte {offset + done}")
                done += count
        return view

    def release(self) -> None:
        """Frees the buffer (the loader is done with the file's tensors)."""
        self._buffer = None


class GGUFTensor:
    """One tensor of a GGUF file, read when asked for (a models/weights.py TensorSource)."""

    def __init__(
        self,
        reader: FileReader,
        name: str,
        entry: dict[str, Any],
        order: torch.Tensor | None,
    ) -> None:
        self.reader, self.name = reader, name
        self.shape = tuple(reversed(entry["shape"]))  # PyTorch's order: [out, in]
        self.type, self.nbytes, self.offset = entry["type"], entry["nbytes"], entry["offset"]
        self.order = order  # row r of ours is the file's row order[r]

    def dense(self) -> torch.Tensor:
        raw = self.reader.read(self.offset, self.nbytes)
        rows = math.prod(self.shape[:-1])
        array = dequantize(
            raw.reshape(*self.shape[:-1], self.nbytes // rows), gguf.GGMLQuantizationType(self.type)
        )
        value = torch.from_numpy(np.array(array, dtype=np.float32, order="C"))  # a copy
        value = value.reshape(self.shape)
        return value if self.order is None else value[self.order]

    def packed(self, kernels: native.Kernels) -> PackedWeight:
        out, width = self.shape
        raw = self.reader.read(self.offset, self.nbytes)
        return PackedWeight.repack(kernels, self.type, raw.ctypes.data, out, width, self.order)


def gguf_tensors(
    table: list[dict[str, Any]], architecture: str, config: ModelConfig, reader: FileReader
) -> dict[str, GGUFTensor]:
    """The tensors we use, under our (Hugging Face) parameter names, unread."""
    norm_names = _NORM_NAMES["gemma3" if architecture == "gemma3" else "llama"]
    found: dict[str, GGUFTensor] = {}
    for entry in table:
        name = _hf_name(entry["name"], norm_names)
        if name is None:
            continue
        order = None
        rows = entry["shape"][-1]
        if architecture == "llama" and len(entry["shape"]) == 2:
            # llama.cpp's converter interleaves q/k rows for its rope; undo it for ours.
            if name.endswith("q_proj.weight"):
                order = _unpermuted_rows(rows, config.num_heads)
            elif name.endswith("k_proj.weight"):
                order = _unpermuted_rows(rows, config.num_kv_heads)
        found[name] = GGUFTensor(reader, name, entry, order)
    return found


def _hf_name(gguf_name: str, norm_names: dict[str, str]) -> str | None:
    match = _BLOCK.match(gguf_name)
    if match:
        layer, part, kind = match.groups()
        mapped = _LAYER_NAMES.get(part) or norm_names.get(part)
        return None if mapped is None else f"model.layers.{layer}.{mapped}.{kind}"
    stem, _, kind = gguf_name.rpartition(".")
    mapped = _GLOBAL_NAMES.get(stem)
    return None if mapped is None else f"{mapped}.{kind}"


def _unpermuted_rows(rows: int, num_heads: int) -> torch.Tensor:
    """The file's row for each of our rows of a q or k weight, whose rows llama.cpp's
    converter interleaved per head (pairs of halves) for its own rotary layout."""
    index = torch.arange(rows)
    return index.reshape(num_heads, rows // num_heads // 2, 2).transpose(1, 2).reshape(rows)
