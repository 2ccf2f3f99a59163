"""GGUF: hyper-parameters from metadata, and each tensor read on its own from the file.

Tensors are read where they lie in a read-only mapping of the file, one at a time, and let
go of as soon as they are repacked (FileReader).
"""

from __future__ import annotations

import contextlib
import math
import mmap
import re
import struct
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
    """A GGUF file's header: metadata fields and tensor table (the tensors stay unread)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fields, self.tensors = read_header(path)
        self.architecture: str = self.field("general.architecture")

    def field(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def arch_field(self, key: str, default: Any = None) -> Any:
        return self.field(f"{self.architecture}.{key}", default)

    def config(self) -> ModelConfig:
        arch = self.architecture
        hidden = int(self.arch_field("embedding_length"))
        num_heads = int(self.arch_field("attention.head_count"))
        head_dim = int(self.arch_field("attention.key_length", hidden // num_heads))
        tensor_names = {t["name"] for t in self.tensors}
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
        return self.tensors


# GGUF metadata value types: struct formats of the fixed-size ones (8 is a string, 9 an array).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}  # fmt: skip
_ARRAYS = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
           6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}  # fmt: skip


def read_header(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The metadata fields (arrays as lists) and the tensor table of a GGUF file (version 2 or
    3). A plain reading of the format: `gguf`'s reader builds an object per array element,
    which takes seconds for a large vocabulary."""
    with path.open("rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        magic, version, tensor_count, field_count = struct.unpack_from("<4sIQQ", data, 0)
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"{path} is not a GGUF file of version 2 or 3")
        at = 24

        def string() -> str:
            nonlocal at
            (size,) = struct.unpack_from("<Q", data, at)
            at += 8 + size
            return data[at - size : at].decode("utf-8", errors="replace")

        def value(kind: int) -> Any:
            nonlocal at
            if kind == 8:
                return string()
            if kind == 9:
                item, count = struct.unpack_from("<IQ", data, at)
                at += 12
                if item in _ARRAYS:
                    array: np.ndarray = np.frombuffer(
                        data, dtype=_ARRAYS[item], count=count, offset=at
                    )
                    at += array.nbytes
                    return array.tolist()
                return [value(item) for _ in range(count)]
            (result,) = struct.unpack_from(_SCALARS[kind], data, at)
            at += struct.calcsize(_SCALARS[kind])
            return result

        fields: dict[str, Any] = {}
        for _ in range(field_count):
            key = string()
            (kind,) = struct.unpack_from("<I", data, at)
            at += 4
            fields[key] = value(kind)
        tensors = []
        for _ in range(tensor_count):
            name = string()
            (dims,) = struct.unpack_from("<I", data, at)
            shape = list(struct.unpack_from(f"<{dims}Q", data, at + 4))
            kind, offset = struct.unpack_from("<IQ", data, at + 4 + 8 * dims)
            at += 4 + 8 * dims + 12
            tensors.append({"name": name, "type": kind, "shape": shape, "offset": offset})
        alignment = int(fields.get("general.alignment", 32))
        start = -(-at // alignment) * alignment
        size = len(data)
    # A tensor's size from its type, or (a type `gguf` does not know) up to the next one.
    by_offset = sorted(tensors, key=lambda t: t["offset"])
    ends = [t["offset"] for t in by_offset[1:]] + [size - start]
    for tensor, end in zip(by_offset, ends, strict=True):
        known = _known_bytes(tensor["type"], tensor["shape"])
        tensor["nbytes"] = known if known is not None else end - tensor["offset"]
        tensor["offset"] += start
    return fields, tensors


def _known_bytes(kind: int, shape: list[int]) -> int | None:
    try:
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)]
    except (ValueError, KeyError):
        return None
    return math.prod(shape) // block * size


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
    """One tensor of a GGUF file, read when asked for (a models/weights.py TensorSource)."""

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
