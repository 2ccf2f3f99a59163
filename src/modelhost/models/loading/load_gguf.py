"""GGUF tensors, each read on its own from the file (loading/gguf_header.py reads the header).

Tensors are read where they lie in a read-only mapping of the file, one at a time, and let
go of as soon as they are repacked (FileReader).
"""

from __future__ import annotations

import contextlib
import math
import mmap
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf.quants import dequantize

from modelhost.models.config import ModelConfig

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
    "ffn_gate_inp": "mlp.gate",  # a mixture of experts' router
}
# A mixture of experts' weights, one 3-D tensor [experts, out, in] each, read as one 2-D
# tensor per expert (Hugging Face's per-expert names).
_EXPERT_NAMES = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}
# Llama places its MLP norm after attention; Gemma has four norms per block.
_NORM_NAMES = {
    "llama": {"ffn_norm": "post_attention_layernorm"},
    "gemma": {
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
# Phi-3 stores q, k and v as one tensor, and gate and up as one under ffn_up.
_FUSED_NAMES = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
# Architectures whose q and k rows llama.cpp's converter interleaves for its own rotary.
PERMUTED_ARCHITECTURES = ("llama", "smollm3", "granite")


class FileReader:
    """A GGUF file mapped read-only, its tensors read where they lie. Each tensor's pages leave
    the process's resident set once it has been read (MADV_DONTNEED on a shared file mapping
    drops only this mapping's pages, not the page cache): the loader's memory then grows by
    what the model keeps, not by the file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with path.open("rb") as handle:
            self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)

    @contextlib.contextmanager
    def bytes(self, offset: int, size: int) -> Iterator[np.ndarray]:
        """The file's bytes offset .. offset + size, valid inside the block."""
        if offset + size > self._bytes.size:
            raise OSError(f"{self.path} ends inside tensor data at byte {self._bytes.size}")
        first = offset - offset % mmap.PAGESIZE
        self._map.madvise(mmap.MADV_WILLNEED, first, offset + size - first)
        try:
            yield self._bytes[offset : offset + size]
        finally:
            self._map.madvise(mmap.MADV_DONTNEED, first, offset + size - first)

    def release(self) -> None:
        """Unmaps the file (the loader is done with its tensors)."""
        del self._bytes
        self._map.close()


class GGUFTensor:
    """One tensor of a GGUF file, read when asked for (a models/loading/weights.py TensorSource)."""

    def __init__(
        self,
        reader: FileReader,
        name: str,
        entry: dict[str, Any],
        order: torch.Tensor | None,
    ) -> None:
        self.reader, self.name, self.stored_name = reader, name, entry["name"]
        self.shape = tuple(reversed(entry["shape"]))  # PyTorch's order: [out, in]
        self.type, self.nbytes, self.offset = entry["type"], entry["nbytes"], entry["offset"]
        self.order = order  # row r of ours is the file's row order[r]

    def dense(self) -> torch.Tensor:
        rows = math.prod(self.shape[:-1])
        with self.reader.bytes(self.offset, self.nbytes) as raw:
            array: np.ndarray = dequantize(
                raw.reshape(*self.shape[:-1], self.nbytes // rows),
                gguf.GGMLQuantizationType(self.type),
            )
            value = torch.from_numpy(np.array(array, dtype=np.float32, order="C"))  # a copy
        value = value.reshape(self.shape)
        return value if self.order is None else value[self.order]

    @contextlib.contextmanager
    def stored(self) -> Iterator[int]:
        with self.reader.bytes(self.offset, self.nbytes) as raw:
            yield raw.ctypes.data


def gguf_tensors(
    table: list[dict[str, Any]], architecture: str, config: ModelConfig, reader: FileReader
) -> dict[str, GGUFTensor]:
    """The tensors we use, under our (Hugging Face) parameter names, unread."""
    part_names = _NORM_NAMES[config.architecture]
    if architecture == "phi3":
        part_names = {**part_names, **_FUSED_NAMES}
    found: dict[str, GGUFTensor] = {}
    for entry in table:
        if len(entry["shape"]) == 3:
            found.update(_expert_tensors(entry, reader))
            continue
        name = _hf_name(entry["name"], part_names)
        if name is None:
            continue
        order = None
        rows = entry["shape"][-1]
        if architecture in PERMUTED_ARCHITECTURES and len(entry["shape"]) == 2:
            # llama.cpp's converter interleaves q/k rows for its rope; undo it for ours.
            if name.endswith("q_proj.weight"):
                order = unpermuted_rows(rows, config.num_heads)
            elif name.endswith("k_proj.weight"):
                order = unpermuted_rows(rows, config.num_kv_heads)
        found[name] = GGUFTensor(reader, name, entry, order)
    return found


def _expert_tensors(entry: dict[str, Any], reader: FileReader) -> dict[str, GGUFTensor]:
    """A 3-D expert tensor as one tensor per expert, each its slice of the file."""
    match = _BLOCK.match(entry["name"])
    part = _EXPERT_NAMES.get(match.group(2)) if match else None
    if match is None or part is None:
        return {}
    count = entry["shape"][2]
    size = entry["nbytes"] // count
    found = {}
    for expert in range(count):
        name = f"model.layers.{match.group(1)}.mlp.experts.{expert}.{part}.weight"
        one = {**entry, "shape": entry["shape"][:2], "offset": entry["offset"] + expert * size}
        found[name] = GGUFTensor(reader, name, {**one, "nbytes": size}, None)
    return found


def _hf_name(gguf_name: str, part_names: dict[str, str]) -> str | None:
    match = _BLOCK.match(gguf_name)
    if match:
        layer, part, kind = match.groups()
        mapped = part_names.get(part) or _LAYER_NAMES.get(part)
        return None if mapped is None else f"model.layers.{layer}.{mapped}.{kind}"
    stem, _, kind = gguf_name.rpartition(".")
    mapped = _GLOBAL_NAMES.get(stem)
    return None if mapped is None else f"{mapped}.{kind}"


def unpermuted_rows(rows: int, num_heads: int) -> torch.Tensor:
    """The file's row for each of our rows of a q or k weight, whose rows llama.cpp's
    converter interleaved per head (pairs of halves) for its own rotary layout."""
    index = torch.arange(rows)
    return index.reshape(num_heads, rows // num_heads // 2, 2).transpose(1, 2).reshape(rows)
