"""The native CPU kernels (native_kernels.cpp): compiled once per machine, then loaded.

Linear weights stay in the quantization of the file they came from, repacked losslessly into
tiles (native_qlinear.h, native_repack.h): every row of activations, a prompt token's or a
generated token's, is rounded to 16 bits (two int8 halves under one scale; with
`--prompt-activations 8`, a prompt's rows whose logits nobody reads to 8 bits a 32-input
group, models/kernels/packed.py) and multiplied by the weights' integer levels with AVX-512
VNNI dot products (on CPUs without it, such as AMD's Zen 3, the same source built for AVX2:
native_avx2.h); each weight is read once for up to 8
rows, with the outputs split among all cores (one core alone cannot read memory at full
speed). `paged_attention`, `rms_norm` and `gated_activation` replace a handful of small
PyTorch ops each, and models/kernels/fused_decode.py runs a whole decode step through them. The
library is built with the system's g++ into MODELHOST_HOME/cache/native/<hash of sources,
flags and compiler>/ on first use (a minute on two cores, once per machine; on an AVX2-only
CPU the AVX-512 one is built and refused first) and loaded with ctypes, which releases the
GIL for each call.

Where there is no g++, the CPU has neither AVX-512 VNNI nor AVX2 with FMA and F16C, or
`MODELHOST_NATIVE=0`, `kernels()` is None and models load as fp32 weights on PyTorch's ops
(models/loading/quant.py), at four bytes a parameter.
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
from typing import Any

import torch

from modelhost.models.kernels.structs import STRUCTS, QLinearDesc
from modelhost.paths import modelhost_home

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native_kernels.cpp")
HEADERS = [
    Path(__file__).with_name(name)
    for name in (
        "native_common.h",
        "native_avx2.h",
        "native_qlinear.h",
        "native_bf16.h",
        "native_repack.h",
        "native_moe.h",
        "native_prompt_attention.h",
        "native_kv_q8.h",
        "native_lora.h",
        "native_amx_attention.h",
    )
]
FLAGS = ["-O3", "-shared", "-fPIC", "-std=c++17", "-fopenmp"]
# Builds of the one source, the first whose CPU check passes loads: each is built once.
VARIANTS = {"AVX-512 VNNI": [], "AVX2": ["-DMH_AVX2"]}
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}  # mh_gated_activation's `act`
# The kernels' PoolKind of each pool dtype they read: int8 is the 8-bit cache (models/kv_q8.py).
POOL_KINDS = {torch.float32: 0, torch.float16: 1, torch.int8: 2}
ATTENDED_BY_CALLER = 2  # mh_prompt_attention's mark of a token it leaves to the caller


class StructMismatch(RuntimeError):
    """The library's structs and their ctypes mirrors (kernels/structs.py) disagree."""


def check_struct_sizes(library: Any) -> None:
    """Refuse a library whose structs differ in size from their ctypes mirrors (a field added
    on one side only): passing it one would have a kernel read memory at the wrong offsets."""
    size = library.mh_struct_size
    size.argtypes = [ctypes.c_int32]
    size.restype = ctypes.c_int64
    wrong = [
        f"{struct.__name__} is {size(which)} bytes there and {ctypes.sizeof(struct)} in ctypes"
        for which, struct in enumerate(STRUCTS)
        if size(which) != ctypes.sizeof(struct)
    ]
    if wrong:
        raise StructMismatch(
            "the native kernels' structs do not match models/kernels/structs.py: "
            + "; ".join(wrong)
        )


class Kernels:
    """Typed entry points of the loaded library; arguments are contiguous CPU tensors."""

    def __init__(self, library: ctypes.CDLL) -> None:
        check_struct_sizes(library)
        self.library = library
        # The build's folder: a digest of the sources, flags and compiler (what packed weights
        # written by one build must match to be read by another, loading/packed_cache.py).
        self.build = Path(library._name).parent.name
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
        desc = ctypes.POINTER(QLinearDesc)
        self._qmatmul = library.mh_qmatmul
        self._qmatmul.argtypes = [p, i64, desc, p, i64, ctypes.c_int]
        self._qmatmul.restype = None
        self._qmatmul_bytes = library.mh_qmatmul_bytes
        self._qmatmul_bytes.argtypes = self._qmatmul.argtypes
        self._qmatmul_bytes.restype = None
        self._qrows = library.mh_qrows
        self._qrows.argtypes = [desc, p, i64, p, ctypes.c_int]
        self._qrows.restype = None
        self._bf16 = library.mh_dequantize_bf16
        self._bf16.argtypes = [desc, i64, i64, p, i64, ctypes.c_int]
        self._bf16.restype = None
        self._sizes = library.mh_packed_sizes
        self._sizes.argtypes = [i32, i64, i64, p]
        self._sizes.restype = ctypes.c_int
        self._repack = library.mh_repack
        self._repack.argtypes = [i32, p, i64, i64, p, p, p, p, ctypes.c_int]
        self._repack.restype = ctypes.c_int
        self._attention = library.mh_paged_attention
        self._attention.argtypes = [p, i64, i64, i64, i64, p, ctypes.c_float, p, p, p]
        self._attention.argtypes += [ctypes.c_int, p, p]
        self._attention.argtypes += [i64, i64, p, i64, ctypes.c_float, ctypes.c_float, p]
        self._attention.argtypes += [ctypes.c_int]
        self._attention.restype = None
        self._prompt_attention = library.mh_prompt_attention
        self._prompt_attention.argtypes = [p, i64, i64, i64, i64, p, ctypes.c_float, p, p, p]
        self._prompt_attention.argtypes += [ctypes.c_int, p, p, i64, i64, p, p]
        self._prompt_attention.argtypes += [i64, ctypes.c_float, ctypes.c_float, p, ctypes.c_int]
        self._prompt_attention.restype = None
        self._prompt_groups = library.mh_prompt_attention_groups
        self._prompt_groups.argtypes = [i64]
        self._prompt_groups.restype = ctypes.c_int
        self._rms_norm = library.mh_rms_norm
        self._rms_norm.argtypes = [p, p, i64, i64, ctypes.c_float, p, ctypes.c_int]
        self._rms_norm.restype = None
        self._gated = library.mh_gated_activation
        self._gated.argtypes = [p, i64, i64, ctypes.c_int, p, ctypes.c_int]
        self._gated.restype = None
        self._layers = library.mh_decode_layers
        self._layers.argtypes = [p, p, i64, p]
        self._layers.restype = None
        self._moe = library.mh_moe
        self._moe.argtypes = [p, i64, i64, p, p, ctypes.c_int]
        self._moe.restype = None
        self._choose = library.mh_choose_tokens
        self._choose.argtypes = [p, i64, i64, p, p, p, ctypes.c_int]
        self._choose.restype = None
        self._amx_attention = library.mh_amx_attention
        self._amx_attention.argtypes = [p, i64, p, ctypes.c_int, i64, i64, p, i64, i64, i64]
        self._amx_attention.argtypes += [ctypes.c_float, p, p, ctypes.c_int]
        self._amx_attention.restype = None
        # Whether amx_attention runs here: AMX bf16 tiles, granted to this process by Linux.
        self.amx = bool(library.mh_amx_ready())
        # Threads per call: weights stream from memory, and one core alone cannot saturate it.
        self.threads = os.cpu_count() or 1

    def qmatmul(
        self,
        x: torch.Tensor,
        weight: QLinearDesc,
        y: torch.Tensor,
        column: int,
        coarse: bool = False,
    ) -> None:
        """y[:, column : column + weight.out] = x @ weight.T: x [rows, weight.padded] fp32
        contiguous (zeros beyond the weight's inputs), y [rows, n] fp32 contiguous. A quantized
        weight takes x rounded to 16 bits a row, or with `coarse` to 8 bits each 32 inputs
        (llama.cpp's Q8_0 activations: about 1.6x the speed, a little less precise)."""
        address = y.data_ptr() + 4 * column
        matmul = self._qmatmul_bytes if coarse else self._qmatmul
        matmul(x.data_ptr(), x.shape[0], ctypes.byref(weight), address, y.shape[1], self.threads)

    def qrows(self, weight: QLinearDesc, ids: torch.Tensor) -> torch.Tensor:
        """The weight's rows `ids` (int64), dequantized: [len(ids), weight.padded] fp32."""
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty((ids.numel(), weight.padded), dtype=torch.float32)
        self._qrows(ctypes.byref(weight), ids.data_ptr(), ids.numel(), out.data_ptr(), self.threads)
        return out

    def dequantize_bf16(self, weight: QLinearDesc, first: int, out: torch.Tensor) -> None:
        """out [count, >= weight.padded] bf16 (rows contiguous) = the weight's outputs first ..
        first + count (first a multiple of 16), dequantized and rounded to bf16."""
        count, stride = out.shape[0], out.stride(0)
        self._bf16(ctypes.byref(weight), first, count, out.data_ptr(), stride, self.threads)

    def packed_sizes(self, format: int, out: int, width: int) -> tuple[int, int, int] | None:
        """Bytes of a packed [out, width] weight's data, params and supers arrays, or None where
        the format or the width is not one the kernels take."""
        sizes = (ctypes.c_int64 * 3)()
        if self._sizes(format, out, width, ctypes.addressof(sizes)) != 0:
            return None
        return sizes[0], sizes[1], sizes[2]

    def repack(
        self,
        format: int,
        source: int,
        out: int,
        width: int,
        order: torch.Tensor | None,
        arrays: tuple[torch.Tensor, ...],
    ) -> None:
        """Repacks a row-major [out, width] tensor of GGUF blocks at address `source` into
        `arrays` (sized by packed_sizes); output row r is the source's row order[r]."""
        data, params, supers = arrays
        status = self._repack(
            format, source, out, width, None if order is None else order.data_ptr(),
            data.data_ptr(), params.data_ptr(), supers.data_ptr(), self.threads,
        )  # fmt: skip
        if status != 0:
            raise ValueError(f"cannot repack a {out} x {width} tensor of GGUF type {format}")

    def moe(self, x: torch.Tensor, description: ctypes.Structure) -> torch.Tensor:
        """mh_moe: a mixture-of-experts MLP (routing and experts) of x [rows, width] (fp32
        contiguous), described by models/networks/moe.py's NativeMoE."""
        rows, width = x.shape
        out = torch.empty_like(x)
        self._moe(
            x.data_ptr(), rows, width, ctypes.byref(description), out.data_ptr(), self.threads
        )  # fmt: skip
        return out

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

    def amx_attention_takes(self, pool: torch.Tensor, dim: int) -> bool:
        """Whether amx_attention runs here over this pool at this head width."""
        readable = pool.dtype in (torch.float32, torch.float16) and cache_readable(pool)
        return self.amx and readable and dim % 32 == 0 and dim <= 256

    def amx_attention(
        self,
        queries: torch.Tensor,
        pool: torch.Tensor,
        kv_head: int,
        table: torch.Tensor,
        block_size: int,
        keys: int,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """softmax(scale * queries . keys^T) . values [queries, dim] fp32 and its rows'
        log-sum-exps [queries], on AMX tiles without a mask (native_amx_attention.h): bf16
        contiguous queries [queries, dim] (a multiple of 32) against the first `keys` positions
        (a multiple of 32) of KV head `kv_head` of a sequence's paged pool [slots, 2, kv_heads,
        dim] (its block table `table`, int64)."""
        count, dim = queries.shape
        table = table.to(torch.int64).contiguous()
        out = torch.empty((count, dim), dtype=torch.float32)
        lse = torch.empty(count, dtype=torch.float32)
        self._amx_attention(
            queries.data_ptr(), count, pool.data_ptr(), pool_kind(pool), pool.shape[2], kv_head,
            table.data_ptr(), block_size, keys, dim, scale, out.data_ptr(), lse.data_ptr(),
            self.threads,
        )  # fmt: skip
        return out, lse

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
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """Attention for tokens of one query each, a decode step's rows or a prompt step's
        tokens, each over its own row of `blocks` up to its position (see mh_paged_attention):
        [tokens, heads * D]. qkv [tokens, (heads + 2 kv_heads) D] fp32 contiguous is normed and
        rotated in place."""
        step = (qkv, heads, kv_heads, qk_norm, rope, pool, slots, blocks, block_size, positions)
        return self._attend(self._attention, *step, window, scale, softcap)

    def prompt_attention_takes(self, heads: int, kv_heads: int) -> bool:
        """Whether prompt_attention takes a model with these heads (query heads a KV head: 1 to
        8, or 16)."""
        return heads % kv_heads == 0 and bool(self._prompt_groups(heads // kv_heads))

    def prompt_attention(
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
        tiled: torch.Tensor,
        window: int,
        scale: float,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """paged_attention for a prompt step whose tokens marked in `tiled` ([tokens] bool, or
        uint8 marks) have the queries of a sequence's consecutive tokens tiled against each
        block of keys (mh_prompt_attention; a sliding window's blocks alone); tokens marked
        ATTENDED_BY_CALLER are only normed, rotated (their queries in qkv, in place) and stored,
        their rows of the result left for the caller; the others attend as paged_attention's
        do: [tokens, heads * D]. Not over an 8-bit pool (the tiled kernel reads fp32 and fp16)."""
        if pool_kind(pool) == POOL_KINDS[torch.int8]:
            raise ValueError("prompt_attention does not read 8-bit KV pools")
        tiled = tiled.to(torch.uint8).contiguous()
        step = (qkv, heads, kv_heads, qk_norm, rope, pool, slots, blocks, block_size, positions)
        return self._attend(self._prompt_attention, *step, tiled.data_ptr(), window, scale, softcap)

    def _attend(
        self,
        kernel: Any,
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
        *options: Any,
    ) -> torch.Tensor:
        """One call of a paged attention kernel: the step's arguments both kernels take, then
        `options` (each kernel's own), then the output and the threads."""
        rows, width = qkv.shape
        dim = width // (heads + 2 * kv_heads)
        out = torch.empty((rows, heads * dim), dtype=torch.float32)
        norm_weight, eps = qk_norm if qk_norm is not None else (None, 0.0)
        cos, sin = rope
        kernel(
            qkv.data_ptr(), rows, heads, kv_heads, dim,
            None if norm_weight is None else norm_weight.data_ptr(), eps,
            cos.data_ptr(), sin.data_ptr(), pool.data_ptr(), pool_kind(pool), slots.data_ptr(),
            blocks.data_ptr(), blocks.shape[1], block_size, positions.data_ptr(),
            *options, out.data_ptr(), self.threads,
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
        (the structures are models/kernels/fused_decode.py's)."""
        self._layers(hidden.data_ptr(), ctypes.addressof(layers), len(layers), ctypes.byref(step))


def readable(x: torch.Tensor) -> bool:
    """Whether the kernels can read x as it is: contiguous fp32 on the CPU."""
    return x.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous()


def cache_readable(pool: torch.Tensor) -> bool:
    """Whether paged_attention can read and write a KV pool: contiguous fp32, fp16 or q8
    (int8 slots with their scales, models/kv_q8.py) on the CPU. prompt_attention takes fp32
    and fp16 alone."""
    return pool.dtype in POOL_KINDS and pool.device.type == "cpu" and pool.is_contiguous()


def pool_kind(pool: torch.Tensor) -> int:
    """The kernels' PoolKind (native_kv_q8.h) of a pool cache_readable takes."""
    return POOL_KINDS[pool.dtype]


def padded_rows(x: torch.Tensor, padded: int) -> torch.Tensor:
    """x as contiguous fp32 rows of `padded` columns (zeros beyond its own)."""
    x = x.float().contiguous()
    if x.shape[1] == padded:
        return x
    return torch.nn.functional.pad(x, (0, padded - x.shape[1]))


@functools.cache
def kernels() -> Kernels | None:
    """The native kernels, or None where they cannot run here (see the module's docstring).
    `MODELHOST_NATIVE`: 0 for none, `avx2` or `avx512` for that build alone (tests compare
    them), anything else for the first this CPU runs."""
    choice = os.environ.get("MODELHOST_NATIVE", "1")
    if choice == "0":
        return None
    variants = {name: flags for name, flags in VARIANTS.items() if _wanted(name, choice)}
    for name, flags in variants.items():
        library = _library(name, flags)
        if library is None:
            return None
        if library.mh_cpu_supported():
            log.info("native kernels: %s", name)
            return Kernels(library)
    log.info("this CPU runs neither native build: weights load as fp32 (models/loading/quant.py)")
    return None


@functools.cache
def avx512_vnni() -> bool:
    """Whether this CPU runs the AVX-512 VNNI build (whichever build `kernels` chose)."""
    library = _library("AVX-512 VNNI", VARIANTS["AVX-512 VNNI"])
    return library is not None and bool(library.mh_cpu_supported())


def _wanted(name: str, choice: str) -> bool:
    if choice == "avx2":
        return name == "AVX2"
    if choice == "avx512":
        return name == "AVX-512 VNNI"
    return True


def _library(name: str, flags: list[str]) -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(str(_build(flags)))
    except subprocess.CalledProcessError as error:
        log.warning("native kernels (%s) failed to build:\n%s", name, error.stderr[-2000:])
    except OSError as error:  # no compiler, or the library does not load
        log.warning("native kernels unavailable (%s)", error)
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
        SOURCE.read_bytes()
        + b"".join(header.read_bytes() for header in HEADERS)
        + " ".join(flags).encode()
        + version.encode()
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
