"""How a model's linear weights are held on the CPU: the modes, and the linear built for each.

Modes (`--quantize`, `MODELHOST_QUANTIZE`, or `load_model(quantize=...)`):

  auto   (default) every weight in its file's own form, packed for the native kernels
         (models/kernels/packed.py): a GGUF's Q4_K stays Q4_K, its Q6_K stays Q6_K, F16 stays F16; a
         Hugging Face folder's bf16/fp16 weights stay 16-bit. Memory about the file's size.
  int8   as auto, but float weights (F32, F16, BF16, and every Hugging Face weight) become
         Q8_0 (8 bits and an fp16 scale per 32 weights): about half of a bf16 folder.
  int4   every weight of more than 4 bits becomes Q4_1 (4 bits, an fp16 scale and minimum
         per 32): about a third of a bf16 folder, and lossy where the file had more bits.
  none   fp32 everywhere, dequantized: the reference maths (the parity tests use it) at
         four bytes a parameter.

Without the native kernels (no C++ compiler, a CPU without AVX2, `MODELHOST_NATIVE=0`) and on
CUDA, weights load dense: fp32 on the CPU, bf16 on CUDA.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import nn

from modelhost.models.kernels.packed import PackedWeight, QuantLinear
from modelhost.models.loading import footprint
from modelhost.models.modes import MODES as MODES

_CHUNK_ROWS = 4096  # rows quantized at once: bounds the fp32 temporaries of a big matrix


class DenseLinear(nn.Module):
    """A dense linear, the weight stored transposed ([in, out]): MKL's small-M sgemm reads a
    row-major [out, in] weight much slower than its transpose (2-3x at 8 rows)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight_t: torch.Tensor
        self.bias: torch.Tensor | None
        self.register_buffer("weight_t", weight.t().contiguous())
        self.register_buffer("bias", bias)
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return torch.matmul(x, self.weight_t)
        return torch.addmm(self.bias, x, self.weight_t)


class Bf16Linear(nn.Module):
    """A float weight held as bf16 and multiplied by PyTorch's bf16 GEMM (oneDNN), for linears
    that see thousands of rows at once (a vision tower's patches): there oneDNN's blocked
    AVX-512 BF16 GEMM runs about twice as fast as the native kernels, which read each weight
    once for up to 8 rows. Activations and outputs are rounded to bf16, as the native kernels
    round activations to 16 bits; accumulation is fp32. Returns bf16: attention, GELU and the
    next linear take it as it is (no fp32 round trip), an fp32 residual add promotes it, and
    the decoder casts image rows to its own dtype (models/networks/decoder.py)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight_t: torch.Tensor
        self.bias: torch.Tensor | None
        self.register_buffer("weight_t", weight.t().to(torch.bfloat16).contiguous())
        self.register_buffer("bias", None if bias is None else bias.to(torch.bfloat16))
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        if self.bias is None:
            y = torch.matmul(rows, self.weight_t)
        else:
            y = torch.addmm(self.bias, rows, self.weight_t)
        return y.view(*x.shape[:-1], self.out_features)


@functools.cache
def _cpu_flags() -> str:
    """/proc/cpuinfo's text ("" where it cannot be read)."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def bf16_gemm_in_hardware() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX-512 BF16 or AMX: Zen 4, Sapphire
    Rapids and later), where Bf16Linear pays; elsewhere oneDNN emulates it slower than the
    native kernels run."""
    flags = _cpu_flags()
    return " avx512_bf16" in flags or " amx_bf16" in flags


def amx_in_hardware() -> bool:
    """Whether this CPU has AMX's bf16 tiles (Sapphire Rapids and later), where oneDNN's bf16
    GEMM outruns the native integer kernels several times over for a long prompt's rows."""
    return " amx_bf16" in _cpu_flags()


def quantize_blocks(weight: torch.Tensor, format: int) -> torch.Tensor:
    """A float [out, width] weight as rows of GGUF blocks of `format` (Q8_0 or Q4_1), uint8
    [out, width / 32 * block bytes]: the scale (and minimum) rounded to fp16 first, levels
    rounded to nearest against the rounded values."""
    out, width = weight.shape
    rows = []
    for chunk in weight.split(_CHUNK_ROWS):
        groups = chunk.float().reshape(chunk.shape[0], width // 32, 32)
        if format == footprint.Q8_0:
            scale = (groups.abs().amax(dim=-1) / 127).half()
            inverse = torch.where(scale > 0, 1 / scale.float(), torch.zeros(()))
            levels = (groups * inverse[..., None]).round_().clamp_(-127, 127).to(torch.int8)
            fields = [scale.view(torch.uint8), levels.view(torch.uint8)]
        elif format == footprint.Q4_1:
            low = groups.amin(dim=-1)
            scale = ((groups.amax(dim=-1) - low) / 15).half()
            low = low.half()
            inverse = torch.where(scale > 0, 1 / scale.float(), torch.zeros(()))
            levels = ((groups - low.float()[..., None]) * inverse[..., None]).round_()
            levels = levels.clamp_(0, 15).to(torch.uint8)
            nibbles = levels[..., :16] | (levels[..., 16:] << 4)
            fields = [scale.view(torch.uint8), low.view(torch.uint8), nibbles]
        else:
            raise ValueError(f"no quantizer for {footprint.TYPE_NAMES.get(format, format)}")
        n = chunk.shape[0]
        blocks = [f.reshape(n, width // 32, -1) for f in fields]
        rows.append(torch.cat(blocks, dim=-1).reshape(n, -1))
    return torch.cat(rows)


def pack_float(weight: torch.Tensor, format: int) -> PackedWeight:
    """A float [out, width] tensor packed as `format`: a float type as it is (converted to
    it), else quantized to it (Q8_0 or Q4_1)."""
    from modelhost.models.kernels import native  # only reached with the kernels present

    kernels = native.kernels()
    assert kernels is not None
    if format in footprint.FLOAT_TYPES:
        dtype = {
            footprint.F32: torch.float32,
            footprint.F16: torch.float16,
            footprint.BF16: torch.bfloat16,
        }
        source = weight.to(dtype[format]).contiguous()
    else:
        source = quantize_blocks(weight, format)
    out, width = weight.shape
    return PackedWeight.repack(kernels, format, source.data_ptr(), out, width)


def describe(network: nn.Module) -> dict[str, int]:
    """How many linears of each kind and format the network holds (logs, benchmarks)."""
    counts: dict[str, int] = {}
    for module in network.modules():
        if isinstance(module, QuantLinear):
            for part in module.parts:
                name = footprint.TYPE_NAMES.get(part.format, str(part.format))
                counts[name] = counts.get(name, 0) + 1
        elif isinstance(module, Bf16Linear):
            counts["bf16 gemm"] = counts.get("bf16 gemm", 0) + 1
        elif isinstance(module, DenseLinear):
            counts["dense"] = counts.get("dense", 0) + 1
    return counts
