"""A GGUF file's header: its metadata fields, the hyper-parameters they give, and its tensor
table, read without PyTorch (the registry reads every file's header this way)."""

from __future__ import annotations

import math
import mmap
import struct
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from modelhost.models.config import ModelConfig
from modelhost.models.loading.hf_config import UnsupportedRope


class GGUFFile:
    """A GGUF file's header: metadata fields and tensor table (the tensors stay unread)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        # Each tensor's name, GGUF type, shape (the file's order), offset and size: all a later
        # load needs to read it, without parsing the header again.
        self.fields, self.tensors = read_header(path)
        self.architecture: str = self.field("general.architecture")
        self._prefix: bytes | None = None

    @classmethod
    def from_prefix(cls, name: str, prefix: bytes, file_size: int) -> GGUFFile:
        """The header of a file not on disk, from its first bytes (a range request's body);
        raises HeaderTruncated when they end before what is read."""
        gguf_file = cls.__new__(cls)
        gguf_file.path = Path(name)
        gguf_file.fields, gguf_file.tensors = parse_header(prefix, file_size, name)
        gguf_file.architecture = gguf_file.field("general.architecture")
        gguf_file._prefix = prefix
        return gguf_file

    def field(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def arch_field(self, key: str, default: Any = None) -> Any:
        return self.field(f"{self.architecture}.{key}", default)

    def config(self) -> ModelConfig:
        arch = self.architecture
        hidden = int(self.arch_field("embedding_length"))
        num_heads = int(self.arch_field("attention.head_count"))
        head_dim = int(self.arch_field("attention.key_length", hidden // num_heads))
        num_layers = int(self.arch_field("block_count"))
        tensor_names = {t["name"] for t in self.tensors}
        vocab = self.arch_field("vocab_size") or len(self.field("tokenizer.ggml.tokens"))
        gemma = arch in ("gemma2", "gemma3")
        fields: dict[str, Any] = dict(
            architecture="gemma" if gemma else "llama",
            model_type=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(self.arch_field("feed_forward_length", 0)),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(self.arch_field("attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            rms_norm_eps=float(self.arch_field("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(self.arch_field("rope.freq_base", 10_000.0)),
            context_length=int(self.arch_field("context_length", 4096)),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
            **self._rope_fields(head_dim, tensor_names),
        )
        window = int(self.arch_field("attention.sliding_window", 0) or 0)
        if gemma:
            # llama.cpp's rule: the 27B models scale queries by the width per head.
            big = num_layers == (46 if arch == "gemma2" else 62)
            fields.update(
                sliding_window=window or (4096 if arch == "gemma2" else 512),
                sliding_window_pattern=2 if arch == "gemma2" else 6,
                query_pre_attn_scalar=float(hidden // num_heads if big else head_dim),
                final_logit_softcapping=self.arch_field("final_logit_softcapping"),
                attn_logit_softcapping=self.arch_field("attn_logit_softcapping"),
            )
            if arch == "gemma3":
                fields["rope_local_theta"] = float(self.arch_field("rope.freq_base_swa", 10_000.0))
        elif window > 0:  # Mistral, Phi-3: every layer
            fields.update(sliding_window=window, layer_kinds=("sliding",) * num_layers)
        sections = [int(size) for size in self.arch_field("rope.dimension_sections") or ()]
        while sections and sections[-1] == 0:  # llama.cpp pads M-RoPE's three to four
            sections.pop()
        if sections:
            fields["mrope_section"] = tuple(sections)
        if arch == "smollm3":  # llama.cpp's rule: every fourth layer attends without rotary
            fields["no_rope_layers"] = tuple(i for i in range(num_layers) if (i + 1) % 4 == 0)
        for key, name in _MULTIPLIERS.items():
            if self.arch_field(key) is not None:
                fields[name] = float(self.arch_field(key))
        expert_count = int(self.arch_field("expert_count", 0) or 0)
        if expert_count:
            fields.update(self._experts(expert_count, tensor_names))
        return ModelConfig(**fields)

    def _rope_fields(self, head_dim: int, tensor_names: set[str]) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        rope_dim = int(self.arch_field("rope.dimension_count", head_dim))
        if rope_dim < head_dim:
            fields["rope_dim"] = rope_dim
        factor = self.arch_field("rope.scaling.factor")
        kind = self.arch_field("rope.scaling.type", "linear" if factor else "none")
        if kind == "linear":
            fields["rope_scaling_factor"] = float(factor or 1.0)
        elif kind not in ("none", "longrope", "su"):
            raise UnsupportedRope(f"rotary scaling '{kind}' is not supported")
        if "rope_freqs.weight" in tensor_names:  # Llama 3.1's scaling, as a divisor each
            fields["rope_freq_factors"] = self._small_f32("rope_freqs.weight")
        elif "rope_factors_short.weight" in tensor_names:  # Phi-3's longrope
            fields["rope_freq_factors"] = self._small_f32("rope_factors_short.weight")
            fields["rope_long_freq_factors"] = self._small_f32("rope_factors_long.weight")
            original = self.arch_field("rope.scaling.original_context_length")
            fields["rope_original_context"] = int(original or 4096)
            attention = self.arch_field("rope.scaling.attn_factor")
            if attention is not None:
                fields["rope_attention_factor"] = float(attention)
        return fields

    def _small_f32(self, name: str) -> tuple[float, ...]:
        """A small F32 tensor's values, read straight from the file."""
        entry = next(t for t in self.tensors if t["name"] == name)
        if entry["type"] != 0:
            raise ValueError(f"{self.path}: {name} is not F32")
        count, offset = math.prod(entry["shape"]), entry["offset"]
        if self._prefix is not None:  # a header read from a range request
            if offset + 4 * count > len(self._prefix):
                raise HeaderTruncated(offset + 4 * count)
            values = np.frombuffer(self._prefix, dtype=np.float32, count=count, offset=offset)
        else:
            values = np.fromfile(self.path, dtype=np.float32, count=count, offset=offset)
        return tuple(float(v) for v in values)

    def _experts(self, count: int, tensor_names: set[str]) -> dict[str, Any]:
        """A mixture-of-experts file's fields (llama.cpp's `qwen3moe` keys). Its layers without
        a router keep a dense MLP; llama.cpp renormalises the chosen experts' weights unless
        `expert_weights_norm` says otherwise."""
        layers = int(self.arch_field("block_count"))
        dense = (i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names)
        return dict(
            num_experts=count,
            num_experts_per_tok=int(self.arch_field("expert_used_count")),
            moe_intermediate_size=int(self.arch_field("expert_feed_forward_length")),
            norm_topk_prob=bool(self.arch_field("expert_weights_norm", True)),
            mlp_only_layers=tuple(dense),
        )


# GGUF keys of Granite's multipliers and ModelConfig's names for them.
_MULTIPLIERS = {
    "embedding_scale": "embedding_multiplier",
    "residual_scale": "residual_multiplier",
    "attention.scale": "attention_multiplier",
    "logit_scale": "logits_scaling",
}

# GGUF metadata value types: struct formats of the fixed-size ones (8 is a string, 9 an array).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}  # fmt: skip
_ARRAYS = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
           6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}  # fmt: skip


class HeaderTruncated(Exception):
    """The bytes given end before the header does: `needed` is a length known to be short of
    the end (read more than that and try again)."""

    def __init__(self, needed: int) -> None:
        super().__init__(f"the GGUF header goes on past byte {needed}")
        self.needed = needed


def read_header(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The metadata fields (arrays as lists) and the tensor table of a GGUF file (version 2 or
    3). A plain reading of the format: `gguf`'s reader builds an object per array element,
    which takes seconds for a large vocabulary."""
    with path.open("rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return parse_header(data, len(data), str(path))


def parse_header(
    data: bytes | mmap.mmap, file_size: int, name: str
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """`read_header` of a file of `file_size` bytes whose first bytes are `data` (all of them,
    or a prefix: HeaderTruncated when the header does not end inside it)."""
    try:
        return _parse_header(data, file_size, name)
    except (struct.error, IndexError) as exc:
        raise HeaderTruncated(len(data)) from exc


def _parse_header(
    data: bytes | mmap.mmap, file_size: int, name: str
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    magic, version, tensor_count, field_count = struct.unpack_from("<4sIQQ", data, 0)
    if magic != b"GGUF" or version not in (2, 3):
        raise ValueError(f"{name} is not a GGUF file of version 2 or 3")
    at = 24

    def string() -> str:
        nonlocal at
        (size,) = struct.unpack_from("<Q", data, at)
        at += 8 + size
        if at > len(data):
            raise IndexError(at)
        return data[at - size : at].decode("utf-8", errors="replace")

    def value(kind: int) -> Any:
        nonlocal at
        if kind == 8:
            return string()
        if kind == 9:
            item, count = struct.unpack_from("<IQ", data, at)
            at += 12
            if item in _ARRAYS:
                width = np.dtype(_ARRAYS[item]).itemsize
                if at + count * width > len(data):
                    raise IndexError(at + count * width)
                array: np.ndarray = np.frombuffer(data, dtype=_ARRAYS[item], count=count, offset=at)
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
        tensor_name = string()
        (dims,) = struct.unpack_from("<I", data, at)
        shape = list(struct.unpack_from(f"<{dims}Q", data, at + 4))
        kind, offset = struct.unpack_from("<IQ", data, at + 4 + 8 * dims)
        at += 4 + 8 * dims + 12
        tensors.append({"name": tensor_name, "type": kind, "shape": shape, "offset": offset})
    alignment = int(fields.get("general.alignment", 32))
    start = -(-at // alignment) * alignment
    # A tensor's size from its type, or (a type `gguf` does not know) up to the next one.
    by_offset = sorted(tensors, key=lambda t: t["offset"])
    ends = [t["offset"] for t in by_offset[1:]] + [file_size - start] if by_offset else []
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
