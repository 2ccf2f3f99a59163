"""What a checkpoint's weights hold once loaded, and whether the kernels can run them: from
GGUF type ids and shapes alone, without PyTorch (the registry estimates every model this way;
models/kernels/packed.py builds the weights these figures describe)."""

from __future__ import annotations

import math
from collections.abc import Iterable

PAD = 64  # the kernels read inputs in runs of 64

# GGUF's type ids (ggml.h), which name the packed formats too.
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 0, 1, 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, BF16 = 10, 11, 12, 13, 14, 30
TYPE_NAMES = {
    F32: "F32", F16: "F16", BF16: "BF16", Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0",
    Q5_1: "Q5_1", Q8_0: "Q8_0", Q2_K: "Q2_K", Q3_K: "Q3_K", Q4_K: "Q4_K", Q5_K: "Q5_K",
    Q6_K: "Q6_K",
}  # fmt: skip
PACKED_TYPES = frozenset(TYPE_NAMES)
FLOAT_TYPES = frozenset((F32, F16, BF16))
_AT_MOST_4_BITS = (Q2_K, Q3_K, Q4_0, Q4_1, Q4_K)
_SAFETENSORS_FLOATS = {"F32": F32, "F16": F16, "BF16": BF16}

# Bytes of a packed tile of 16 outputs by 32 inputs, its parameters, and a K type's
# super-block factors per 16 outputs by 256 inputs (native_qlinear.h's storage; the native
# kernels' mh_packed_sizes is the authority, and tests hold the two together).
_TILE_BYTES = {F32: 2048, F16: 1024, BF16: 1024, Q4_0: 256, Q4_1: 256, Q5_0: 320, Q5_1: 320,
               Q8_0: 512, Q2_K: 128, Q3_K: 192, Q4_K: 256, Q5_K: 320, Q6_K: 384}  # fmt: skip
_PARAM_BYTES = {Q4_0: 32, Q4_1: 64, Q5_0: 32, Q5_1: 64, Q8_0: 32, Q2_K: 64, Q3_K: 32, Q4_K: 32,
                Q5_K: 32, Q6_K: 32}  # fmt: skip
_SUPER_BYTES = 64


def packed_bytes(format: int, out: int, width: int) -> int:
    """Bytes a packed [out, width] weight of `format` holds (outputs padded to 16, inputs
    to 64), without building it."""
    blocks, groups = -(-out // 16), padded_width(width) // 32
    supers = groups // 8 * _SUPER_BYTES if Q2_K <= format <= Q6_K else 0
    return blocks * (groups * (_TILE_BYTES[format] + _PARAM_BYTES.get(format, 0)) + supers)


def safetensors_type(dtype: str) -> int:
    """The GGUF type a safetensors tensor of `dtype` loads as: F16 and BF16 as they are, any
    other float as F32."""
    return _SAFETENSORS_FLOATS.get(dtype, F32)


def padded_width(width: int) -> int:
    return -(-width // PAD) * PAD


QUANT_BLOCK = 32  # weights per block of the formats int8 and int4 quantize to


def target_type(source_type: int, mode: str, width: int = QUANT_BLOCK) -> int:
    """The packed format a weight of GGUF type `source_type` and `width` inputs takes in
    `mode` (not `none`). A width that is not whole blocks keeps its type (a vision tower's
    patch embedding: 3 x 2 x 14 x 14 = 1176 inputs), as llama.cpp's converter keeps it."""
    if width % QUANT_BLOCK:
        return source_type
    if mode == "int8" and source_type in FLOAT_TYPES:
        return Q8_0
    if mode == "int4" and source_type not in _AT_MOST_4_BITS:
        return Q4_1
    return source_type


def held_bytes(tensors: Iterable[tuple[int, tuple[int, ...]]], mode: str, *, cuda: bool) -> int:
    """Bytes the weights of a checkpoint's tensors, each (GGUF type, shape in PyTorch's order),
    hold once loaded in `mode`: packed in their target type on CPUs, dense fp32 (`none`, 1-D
    tensors) or bf16 on CUDA otherwise."""
    total = 0
    for qtype, shape in tensors:
        if len(shape) in (2, 3) and mode != "none" and not cuda and qtype in PACKED_TYPES:
            # a mixture of experts' [experts, out, in] tensor: one packed weight an expert
            experts = shape[0] if len(shape) == 3 else 1
            total += experts * packed_bytes(target_type(qtype, mode, shape[-1]), *shape[-2:])
        else:
            total += math.prod(shape) * (2 if cuda else 4)
    return total


def unsupported_tensor(tensors: Iterable[tuple[str, int, int]]) -> str | None:
    """Why a checkpoint cannot be run, from its tensors (name, GGUF type, dimensions): the
    first matrix in a type the kernels do not take, else None."""
    for name, qtype, dims in tensors:
        if dims in (2, 3) and qtype not in PACKED_TYPES:  # 3: experts' matrices
            import gguf  # only for the refusal's type name

            try:
                type_name = gguf.GGMLQuantizationType(qtype).name
            except ValueError:
                type_name = f"GGUF type {qtype}"
            supported = ", ".join(TYPE_NAMES[t] for t in sorted(PACKED_TYPES))
            return f"tensor {name} is {type_name}, which modelhost does not run ({supported})"
    return None
