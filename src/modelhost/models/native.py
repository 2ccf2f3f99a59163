"""The native CPU kernels (native_kernels.cpp): compiled once per machine, then loaded.

PyTorch's CPU kernels for weight-only int4/int8 matmuls want bf16 activations, which these
CPUs multiply without bf16 instructions. The native ones take fp32 activations and give fp32
out: each row of activations is rounded to 16 bits (two int8 halves under one scale) and
multiplied by the int4/int8 weights with AVX-512 VNNI integer dot products (on CPUs without
it, such as AMD's Zen 3, the same source built for AVX2: native_avx2.h); each weight is read
once for up to 8 rows, with the outputs split among all cores (one core alone cannot
read memory at full speed). `paged_attention`, `rms_norm` and `gated_activation` replace a
handful of small PyTorch ops each, and models/fused_decode.py runs a whole decode step
through them. The library is built with the system's g++ into
MODELHOST_HOME/cache/native/<hash of source, flags and compiler>/ on first use (a few seconds
a variant; on an AVX2-only CPU the AVX-512 one is built and refused first) and loaded with
ctypes, which releases the GIL for each call.

Where there is no g++, the CPU has neither AVX-512 VNNI nor AVX2 with FMA and F16C, or
`MODELHOST_NATIVE=0`, `kernels()` is None and the models run on PyTorch's ops and kernels.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

import torch

from modelhost.paths import modelhost_home

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native_kernels.cpp")
AVX2_HEADER = Path(__file__).with_name("native_avx2.h")
FLAGS = ["-O3", "-shared", "-fPIC", "-std=c++17", "-fopenmp"]
# Builds of the one source, the first whose CPU check passes loads: each is built once.
VARIANTS = {"AVX-512 VNNI": [], "AVX2": ["-DMH_AVX2"]}
PAD = 64  # the kernels read inputs in runs of 64
GROUP = 32  # inputs sharing an int4 scale and min
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}  # mh_gated_activation's `act`


class Kernels:
    """Typed entry points of the loaded library; arguments are contiguous CPU tensors."""

    def __init__(self, library: ctypes.CDLL) -> None:
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self._int4 = library.mh_int4_matmul
        self._int4.argtypes = [p, i64, p, p, i64, i64, p, ctypes.c_int]
        self._int4.restype = None
        self._int8 = library.mh_int8_matmul
        self._int8.argtypes = [p, i64, p, p, i64, i64, p, ctypes.c_int]
        self._int8.restype = None
        self._attention = library.mh_paged_attention
        self._attention.argtypes = [p, i64, i64, i64, i64, p, ctypes.c_float, p, p, p]
        self._attention.argtypes += [ctypes.c_int, p, p]
        self._attention.argtypes += [i64, i64, p, i64, ctypes.c_float, p, ctypes.c_int]
        self._attention.restype = None
        self._rms_norm = library.mh_rms_norm
        self._rms_norm.argtypes = [p, p, i64, i64, ctypes.c_float, p, ctypes.c_int]
        self._rms_norm.restype = None
        self._gated = library.mh_gated_activation
        self._gated.argtypes = [p, i64, i64, ctypes.c_int, p, ctypes.c_int]
        self._gated.restype = None
        self._layers = library.mh_decode_layers
        self._layers.argtypes = [p, p, i64, p]
        self._layers.restype = None
        self._rank = library.mh_int4_rank
        self._rank.argtypes = [p, i64, i64, p, p, i64, i64, p, p, ctypes.c_int]
        self._rank.restype = None
        self._top = library.mh_top_candidates
        self._top.argtypes = [p, i64, i64, i64, p, p, ctypes.c_int]
        self._top.restype = None
        self._refine = library.mh_refine
        self._refine.argtypes = [p, i64, i64, p, p, i64, p, i64, ctypes.c_int]
        self._refine.restype = None
        self._choose = library.mh_choose_tokens
        self._choose.argtypes = [p, i64, i64, p, p, p, ctypes.c_int]
        self._choose.restype = None
        # Threads per call: weights stream from memory, and one core alone cannot saturate it.
        self.threads = os.cpu_count() or 1

    def int4_matmul(
        self, x: torch.Tensor, nibbles: torch.Tensor, params: torch.Tensor, out: int
    ) -> torch.Tensor:
        """x [rows, in] fp32 times the int4 weight of `out` outputs (`pack_int4`): [rows, out]."""
        x = _padded_rows(x, nibbles.shape[1] * GROUP)
        y = torch.empty((x.shape[0], out), dtype=torch.float32)
        self._int4(
            x.data_ptr(), x.shape[0], nibbles.data_ptr(), params.data_ptr(), out, x.shape[1],
            y.data_ptr(), self.threads,
        )  # fmt: skip
        return y

    def int8_matmul(
        self, x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor
    ) -> torch.Tensor:
        """x [rows, in] fp32 times the int8 weight (`pack_int8`) and its per-output scales."""
        out, padded = scales.shape[0], weight.shape[1] * 4
        x = _padded_rows(x, padded)
        y = torch.empty((x.shape[0], out), dtype=torch.float32)
        self._int8(
            x.data_ptr(), x.shape[0], weight.data_ptr(), scales.data_ptr(), out, padded,
            y.data_ptr(), self.threads,
        )  # fmt: skip
        return y

    def int4_rank(
        self, x: torch.Tensor, nibbles: torch.Tensor, params: torch.Tensor, group: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Approximate x [rows, in] @ weight.T for ranking (see mh_int4_rank): the weight's
        nibbles [out, bytes] in 16 groups of `group` inputs and their fp16 scales and mins
        [out, 32]. Also the largest of each 16 consecutive outputs, [rows, out / 16 rounded
        up], for top_candidates."""
        x = x.float().contiguous()
        out = nibbles.shape[0]
        y = torch.empty((x.shape[0], out), dtype=torch.float32)
        maxima = torch.empty((x.shape[0], -(-out // 16)), dtype=torch.float32)
        self._rank(
            x.data_ptr(), x.shape[0], x.shape[1], nibbles.data_ptr(), params.data_ptr(), out,
            group, y.data_ptr(), maxima.data_ptr(), self.threads,
        )  # fmt: skip
        return y, maxima

    def top_candidates(
        self, scores: torch.Tensor, k: int, maxima: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The indices [rows, k] of each row's k largest scores (contiguous fp32 [rows, n],
        k <= n), in no particular order: torch.topk(sorted=False)'s set, ties aside. `maxima`:
        int4_rank's largest of each 16 scores, which spares a pass over them."""
        rows, n = scores.shape
        indices = torch.empty((rows, k), dtype=torch.int64)
        runs = None if maxima is None else maxima.data_ptr()
        self._top(scores.data_ptr(), rows, n, k, runs, indices.data_ptr(), self.threads)
        return indices

    def refine(
        self, x: torch.Tensor, weight: torch.Tensor, indices: torch.Tensor, logits: torch.Tensor
    ) -> None:
        """logits[r, j] = x[r] . weight[j] for each j of indices[r], in place (all contiguous:
        x [rows, width] and weight [n, width] fp32, indices [rows, k] int64, logits [rows, n])."""
        rows, width = x.shape
        self._refine(
            x.data_ptr(), rows, width, weight.data_ptr(), indices.data_ptr(), indices.shape[1],
            logits.data_ptr(), logits.shape[1], self.threads,
        )  # fmt: skip

    def choose_tokens(
        self,
        logits: torch.Tensor,
        uniforms: torch.Tensor | None,
        temperatures: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One token id per row of contiguous fp32 logits [rows, n]: the argmax (uniforms None)
        or an inverse-CDF draw from the row's softmax with its uniform in [0, 1) (fp32 [rows]),
        of the logits over the row's temperature where `temperatures` (fp32 [rows]) is given."""
        rows, n = logits.shape
        chosen = torch.empty(rows, dtype=torch.int64)
        self._choose(
            logits.data_ptr(), rows, n, None if uniforms is None else uniforms.data_ptr(),
            None if temperatures is None else temperatures.data_ptr(), chosen.data_ptr(),
            self.threads,
        )  # fmt: skip
        return chosen

    def paged_attention(
        self,
        qkv: torch.Tensor,
        heads: int,
        kv_heads: int,
        qk_norm: tuple[torch.Tensor, float] | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        pool: torch.Tensor,
        slots: torch.Tensor,
        blocks: torch.Tensor,
        block_size: int,
        positions: torch.Tensor,
        window: int,
        scale: float,
    ) -> torch.Tensor:
        """Attention for tokens of one query each, a decode step's rows or a prompt step's
        tokens, each over its own row of `blocks` up to its position (see mh_paged_attention):
        [tokens, heads * D]. qkv [tokens, (heads + 2 kv_heads) D] fp32 contiguous is normed and
        rotated in place."""
        rows, width = qkv.shape
        dim = width // (heads + 2 * kv_heads)
        out = torch.empty((rows, heads * dim), dtype=torch.float32)
        norm_weight, eps = qk_norm if qk_norm is not None else (None, 0.0)
        cos, sin = rope
        self._attention(
            qkv.data_ptr(), rows, heads, kv_heads, dim,
            None if norm_weight is None else norm_weight.data_ptr(), eps,
            cos.data_ptr(), sin.data_ptr(), pool.data_ptr(), half_pool(pool), slots.data_ptr(),
            blocks.data_ptr(), blocks.shape[1], block_size, positions.data_ptr(), window,
            scale, out.data_ptr(), self.threads,
        )  # fmt: skip
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """torch.rms_norm over the last dimension of a contiguous fp32 x, in one call."""
        out = torch.empty_like(x)
        dim = x.shape[-1]
        rows = x.numel() // dim
        self._rms_norm(
            x.data_ptr(), weight.data_ptr(), rows, dim, eps, out.data_ptr(), self.threads
        )  # fmt: skip
        return out

    def gated_activation(self, gate_up: torch.Tensor, act: int) -> torch.Tensor:
        """act(gate) * up for contiguous fp32 rows of (gate, up); act: one of `ACTIVATIONS`."""
        width = gate_up.shape[-1] // 2
        out = gate_up.new_empty((*gate_up.shape[:-1], width))
        rows = gate_up.numel() // (2 * width)
        self._gated(gate_up.data_ptr(), rows, width, act, out.data_ptr(), self.threads)
        return out

    def decode_layers(
        self, hidden: torch.Tensor, layers: ctypes.Array, step: ctypes.Structure
    ) -> None:
        """mh_decode_layers: hidden [rows, width] through the described layers, in place
        (the structures are models/fused_decode.py's)."""
        self._layers(hidden.data_ptr(), ctypes.addressof(layers), len(layers), ctypes.byref(step))


def readable(x: torch.Tensor) -> bool:
    """Whether the kernels can read x as it is: contiguous fp32 on the CPU."""
    return x.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous()


def cache_readable(pool: torch.Tensor) -> bool:
    """Whether the attention kernels can read and write a KV pool: contiguous fp32 or fp16 on
    the CPU."""
    cached = (torch.float32, torch.float16)
    return pool.dtype in cached and pool.device.type == "cpu" and pool.is_contiguous()


def half_pool(pool: torch.Tensor) -> int:
    """The kernels' flag for a pool of fp16 (1) or fp32 (0) keys and values."""
    return int(pool.dtype == torch.float16)


def _padded_rows(x: torch.Tensor, padded: int) -> torch.Tensor:
    """x as contiguous fp32 rows of `padded` columns (zeros beyond its own)."""
    x = x.float().contiguous()
    if x.shape[1] == padded:
        return x
    return torch.nn.functional.pad(x, (0, padded - x.shape[1]))


def padded_width(width: int) -> int:
    return -(-width // PAD) * PAD


def int4_params(scales: torch.Tensor, mins: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Group scales and mins [out, in/32] as the kernel reads them (fp16: GGUF's own precision
    for Q4_0/Q4_1), returned as fp32 so that other paths can use the same values."""
    return scales.half().float(), mins.half().float()


def pack_int4(
    q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [out, in/32, 32] levels 0..15 with their (`int4_params`) scales and mins [out, in/32]
    -> the kernel's operands, by blocks of 16 outputs and groups of 32 inputs (outputs and
    inputs padded with zeros to multiples of 16 and 64): nibbles [blocks, groups, 256] uint8
    (run j of 64 bytes: byte 4o + k holds output o's input 8j + k, low, and 8j + 4 + k, high)
    and params [blocks, groups, 32] fp16 (the 16 outputs' scales, then their mins)."""
    out, groups = scales.shape
    blocks = -(-out // 16)
    padded_groups = padded_width(groups * GROUP) // GROUP
    levels = q.new_zeros((blocks * 16, padded_groups, GROUP), dtype=torch.uint8)
    levels[:out, :groups] = q
    params = torch.zeros((blocks * 16, padded_groups, 2), dtype=torch.float16)
    params[:out, :groups] = torch.stack((scales, mins), dim=-1).half()
    # [block, output, group, run, nibble, k] -> [block, group, run, output, k, nibble]
    runs = levels.view(blocks, 16, padded_groups, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)
    nibbles = (runs[..., 0] | (runs[..., 1] << 4)).reshape(blocks, padded_groups, 256)
    params = params.view(blocks, 16, padded_groups, 2).permute(0, 2, 3, 1)
    return nibbles.contiguous(), params.reshape(blocks, padded_groups, 32).contiguous()


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 levels [out, in] (-127..127) -> the kernel's operand, by blocks of 16
    outputs (padded with zero levels to multiples of 16 outputs and 64 inputs): [blocks,
    in/4, 64] uint8, byte 4o + k of quad j holding output o's input 4j + k, + 128 (VNNI
    multiplies unsigned by signed bytes)."""
    out, width = q.shape
    blocks, padded = -(-out // 16), padded_width(width)
    levels = torch.zeros((blocks * 16, padded), dtype=torch.int16)
    levels[:out, :width] = q
    quads = (levels + 128).to(torch.uint8).view(blocks, 16, padded // 4, 4).transpose(1, 2)
    return quads.reshape(blocks, padded // 4, 64).contiguous()


@functools.cache
def kernels() -> Kernels | None:
    """The native kernels, or None where they cannot run here (see the module's docstring)."""
    if os.environ.get("MODELHOST_NATIVE", "1") == "0":
        return None
    for name, flags in VARIANTS.items():
        try:
            library = ctypes.CDLL(str(_build(flags)))
        except subprocess.CalledProcessError as error:
            log.warning("native kernels (%s) failed to build:\n%s", name, error.stderr[-2000:])
            continue
        except OSError as error:  # no compiler, or the library does not load
            log.warning("native kernels unavailable (%s): using PyTorch's", error)
            return None
        if library.mh_cpu_supported():
            log.info("native kernels: %s", name)
            return Kernels(library)
    log.info("this CPU has neither AVX-512 VNNI nor AVX2: using PyTorch's int4/int8 kernels")
    return None


def _build(variant_flags: list[str]) -> Path:
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        raise FileNotFoundError("no C++ compiler (g++) on PATH")
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True
    ).stdout
    flags = FLAGS + variant_flags
    key = hashlib.sha256(
        SOURCE.read_bytes() + AVX2_HEADER.read_bytes() + " ".join(flags).encode() + version.encode()
    )
    target = modelhost_home() / "cache" / "native" / key.hexdigest()[:16] / "libmodelhost.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed into place: processes starting together (workers)
    # never load a half-written library.
    partial = target.with_suffix(f".{os.getpid()}.partial")
    subprocess.run(
        [compiler, *flags, "-o", str(partial), str(SOURCE)],
        capture_output=True,
        text=True,
        check=True,
    )
    partial.replace(target)
    return target
