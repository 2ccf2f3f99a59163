"""Random quantized blocks in ggml's published layouts (ggml/src/ggml-common.h), written directly.

Quantizing random floats would cost minutes for an 8B file and give nothing a benchmark needs;
instead each block gets uniformly random levels (random bytes: every bit pattern of a level field
is valid) and random scales, with the block scale `d` chosen so the dequantized values have the
requested standard deviation. Scales of both signs where the format allows them (Q3_K, Q6_K, as
llama.cpp's quantizer writes them), and minimums that differ from the scales (Q2_K, Q4_K, Q5_K,
Q4_1, Q5_1), so a kernel that confuses the two fields cannot pass by accident. `d` varies from
block to block by ~10% for the same reason.

`random_blocks(qtype, n_blocks, std, rng)` returns an (n_blocks, type_size) uint8 array that
`gguf.quants.dequantize` reads.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

Q = GGMLQuantizationType
QK_K = 256
JITTER = 0.1  # log-normal spread of `d` across blocks


def _bytes(rng: np.random.Generator, n_blocks: int, width: int) -> np.ndarray:
    """(n_blocks, width) uniformly random bytes: ~2 GB/s, the raw generator's own output."""
    words = -(-n_blocks * width // 8)
    raw = rng.bit_generator.random_raw(words).view(np.uint8)
    return raw[: n_blocks * width].reshape(n_blocks, width)


def _half(values: np.ndarray) -> np.ndarray:
    """float values as little-endian fp16 bytes, (n, 2)."""
    return values.astype("<f2").view(np.uint8).reshape(-1, 2)


def _block_d(rng: np.random.Generator, n_blocks: int, unit_std: float, std: float) -> np.ndarray:
    """Per-block `d` for values whose std is `unit_std * d`, jittered around `std / unit_std`."""
    jitter = np.exp(rng.normal(0.0, JITTER, n_blocks) - JITTER**2)  # mean-square ~1
    return (std / unit_std) * jitter


def _uniform_std(levels: int) -> float:
    """Standard deviation of a level drawn uniformly from `levels` consecutive integers."""
    return float(np.sqrt((levels**2 - 1) / 12))


def _ints(rng: np.random.Generator, shape: tuple[int, ...], low: int, high: int) -> np.ndarray:
    """Uniform integers in [low, high], inclusive."""
    return rng.integers(low, high + 1, size=shape, dtype=np.int16)


def _rms_uniform(low: int, high: int) -> float:
    """Root mean square of an integer drawn uniformly from [low, high]."""
    values = np.arange(low, high + 1, dtype=np.float64)
    return float(np.sqrt(np.mean(values**2)))


def _signed(rng: np.random.Generator, magnitudes: np.ndarray) -> np.ndarray:
    return np.where(rng.random(magnitudes.shape) < 0.5, -magnitudes, magnitudes)


def _q8_0(rng: np.random.Generator, n: int, std: float) -> np.ndarray:
    # Levels in [-127, 127] (-127 twice as likely): llama.cpp's quantizer never writes -128.
    d = _block_d(rng, n, _uniform_std(255), std)
    levels = _bytes(rng, n, 32).view(np.int8)
    levels[levels == -128] = -127
    return np.concatenate([_half(d), levels.view(np.uint8)], axis=1)


def _q4_0(rng: np.random.Generator, n: int, std: float) -> np.ndarray:
    d = _block_d(rng, n, _uniform_std(16), std)  # value = d * (q - 8)
    return np.concatenate([_half(d), _bytes(rng, n, 16)], axis=1)


def _q5_0(rng: np.random.Generator, n: int, std: float) -> np.ndarray:
    d = _block_d(rng, n, _uniform_std(32), std)  # value = d * (q - 16)
    return np.concatenate([_half(d), _bytes(rng, n, 4 + 16)], axis=1)


def _minimum(rng: np.random.Generator, d: np.ndarray, centre: float) -> np.ndarray:
    """Q4_1/Q5_1's `m` (value = d * q + m): about -centre * d, so values centre near zero, off
    by a level or so as real blocks are."""
    return -d * (centre + rng.normal(0.0, 1.0, d.shape))


def _q4_1(rng: np.random.Generator, n: int, std: float) -> np.ndarray:
    d = _block_d(rng, n, _uniform_std(16), std)
    return np.concatenate([_half(d), _half(_minimum(rng, d, 7.5)), _bytes(rng, n, 16)], axis=1)


def _q5_1(rng: np.random.Generator, n: int, std: float) -> np.ndarray:
    d = _block_d(rng, n, _uniform_std(32), std)
    m = _minimum(rng, d, 15.5)
    return np.concatenate([_half(d), _half(m), _bytes(rng, n, 4 + 16)], axis=1)


def _k_scales_and_mins(rng: np.random.Generator, n: int, centre: float, bits: int):
    """Sub-block scales `sc` and minimums `m` for value = d * sc * q - dmin * m, and dmin / d.

    dmin is centre * 1.25 * d, so m ~ 0.8 * sc (jittered by a couple of steps) brings each
    sub-block's mean near zero without m ever equalling sc."""
    top = (1 << bits) - 1
    sub = 16 if bits == 4 else 8  # Q2_K: 16 sub-blocks of 16; Q4_K/Q5_K: 8 of 32
    sc = _ints(rng, (n, sub), (top + 1) // 2, top)
    m = np.clip(np.rint(0.8 * sc + rng.normal(0.0, 1.0, sc.shape)), 0, top).astype(np.int16)
    return sc, m, centre * 1.25, _rms_uniform((top + 1) // 2, top)


def _pack_k4_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 12 bytes of eight 6-bit scales and eight 6-bit minimums: bytes 0-3 hold
    sc[0:4] in their low six bits, 4-7 hold m[0:4]; the top two bits of both, and all of 8-11,
    hold the pieces of sc[4:8] and m[4:8] (low nibble sc, high nibble m)."""
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((m[:, 4:8] & 0x0F) << 4)
    return out


def _q4_k(rng: np.random.Generator, n: int, std: float) -> np.ndarray:
    sc, m, dmin_over_d, sc_rms = _k_scales_and_mins(rng, n, 7.5, 6)
    d = _block_d(rng, n, sc_rms * _uniform_std(16), std)
    head = [_half(d), _half(d * dmin_over_d), _pack_k4_scales(sc, m)]
    return np.concatenate([*head, _bytes(rng, n, QK_K // 2)], axis=1)


def _q5_k(rng: np.random.Generator, n: int, std: float) -> np.ndarray:
    sc, m, dmin_over_d, sc_rms = _k_scales_and_mins(rng, n, 15.5, 6)
    d = _block_d(rng, n, sc_rms * _uniform_std(32), std)
    head = [_half(d), _half(d * dmin_over_d), _pack_k4_scales(sc, m)]
    return np.concatenate([*head, _bytes(rng, n, QK_K // 8 + QK_K // 2)], axis=1)


def _q2_k(rng: np.random.Generator, n: int, std: float) -> np.ndarray:
    # scales[16]: low nibble the scale, high nibble the minimum; then qs, d, dmin.
    sc, m, dmin_over_d, sc_rms = _k_scales_and_mins(rng, n, 1.5, 4)
    d = _block_d(rng, n, sc_rms * _uniform_std(4), std)
    scales = (sc | (m << 4)).astype(np.uint8)
    tail = [_half(d), _half(d * dmin_over_d)]
    return np.concatenate([scales, _bytes(rng, n, QK_K // 4), *tail], axis=1)


def _pack_q3_k_scales(scales: np.ndarray) -> np.ndarray:
    """Q3_K's 12 bytes of sixteen 6-bit scales (stored + 32): bytes 0-7 hold the low nibbles
    of scales 0-7 (low half) and 8-15 (high half); byte 8 + j holds the top two bits of scales
    j, 4 + j, 8 + j and 12 + j, in that order from bit 0."""
    stored = (scales + 32).astype(np.uint8)
    low, high = stored & 0x0F, stored >> 4
    out = np.empty((stored.shape[0], 12), dtype=np.uint8)
    out[:, 0:8] = low[:, 0:8] | (low[:, 8:16] << 4)
    out[:, 8:12] = high[:, 0:4] | (high[:, 4:8] << 2) | (high[:, 8:12] << 4) | (high[:, 12:16] << 6)
    return out


def _q3_k(rng: np.random.Generator, n: int, std: float) -> np.ndarray:
    # value = d * scale * q, q in [-4, 3] (low two bits, minus 4 where the hmask bit is 0)
    scales = _signed(rng, _ints(rng, (n, 16), 8, 31))
    d = _block_d(rng, n, _rms_uniform(8, 31) * _uniform_std(8), std)
    body = _bytes(rng, n, QK_K // 8 + QK_K // 4)  # hmask, qs
    return np.concatenate([body, _pack_q3_k_scales(scales), _half(d)], axis=1)


def _q6_k(rng: np.random.Generator, n: int, std: float) -> np.ndarray:
    # value = d * scale * (q - 32), q in [0, 63]; int8 scales of either sign
    scales = _signed(rng, _ints(rng, (n, 16), 32, 127)).astype(np.int8)
    d = _block_d(rng, n, _rms_uniform(32, 127) * _uniform_std(64), std)
    body = _bytes(rng, n, QK_K // 2 + QK_K // 4)  # ql, qh
    return np.concatenate([body, scales.view(np.uint8), _half(d)], axis=1)


_WRITERS: dict[GGMLQuantizationType, Callable[[np.random.Generator, int, float], np.ndarray]] = {
    Q.Q4_0: _q4_0,
    Q.Q4_1: _q4_1,
    Q.Q5_0: _q5_0,
    Q.Q5_1: _q5_1,
    Q.Q8_0: _q8_0,
    Q.Q2_K: _q2_k,
    Q.Q3_K: _q3_k,
    Q.Q4_K: _q4_k,
    Q.Q5_K: _q5_k,
    Q.Q6_K: _q6_k,
}
BLOCK_TYPES = frozenset(_WRITERS)


def random_blocks(
    qtype: GGMLQuantizationType, n_blocks: int, std: float, rng: np.random.Generator
) -> np.ndarray:
    """`n_blocks` random blocks of `qtype` whose dequantized values have standard deviation
    ~`std`, as an (n_blocks, type_size) uint8 array."""
    blocks = _WRITERS[qtype](rng, n_blocks, std)
    assert blocks.shape == (n_blocks, GGML_QUANT_SIZES[qtype][1]), (qtype, blocks.shape)
    return blocks
