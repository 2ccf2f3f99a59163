"""Random GGUF tensors of every type the kernels take, as the bytes a file holds."""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quantize

T = GGMLQuantizationType
FLOATS = (T.F32, T.F16, T.BF16)
LEGACY = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)
K_TYPES = (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)
ALL_TYPES = FLOATS + LEGACY + K_TYPES
# Where each K type keeps its fp16 super-block factors (d, and dmin where it has one).
_FACTORS = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def random_tensor(qtype: GGMLQuantizationType, out: int, width: int, seed: int = 0) -> np.ndarray:
    """A row-major [out, width] tensor of `qtype` as bytes ([out, bytes a row], uint8).
    K types get random bits everywhere (every level, sub-scale and minimum occurs) but finite,
    small super-block factors; the others quantize random weights of a typical spread."""
    rng = np.random.default_rng(seed)
    if qtype in _FACTORS:
        block, size = GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(out, width // block, size), dtype=np.uint8)
        for offset in _FACTORS[qtype]:
            factor = (rng.random((out, width // block)) * 1e-3 + 1e-4).astype(np.float16)
            raw[:, :, offset : offset + 2] = factor.view(np.uint8).reshape(*factor.shape, 2)
        return raw.reshape(out, -1)
    weights = (rng.standard_normal((out, width)) * 0.02).astype(np.float32)
    if qtype == T.F32:
        return weights.view(np.uint8)
    return np.ascontiguousarray(quantize(weights, qtype))
