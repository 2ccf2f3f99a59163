"""A linear's rows through PyTorch's bf16 GEMM over its packed weights (QuantLinear's bf16
coarse rows, --prompt-activations bf16): on a CPU with AMX oneDNN multiplies bf16 on its tiles
about 4x as fast as the native 16-bit kernels.

Each slice of BF16_SLICE_OUTPUTS outputs of a part is dequantized to bf16 (native_bf16.h) into
a buffer of its thread's and multiplied by every panel of BF16_PANEL_ROWS rows (the last padded
with zeros). oneDNN picks its blocking, and with it the order of a sum, by the matrices' shapes:
fixed shapes keep a row's result independent of the rows beside it and of the thread count.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import torch

from modelhost.models.kernels import native

if TYPE_CHECKING:  # packed.py's QuantLinear calls in here
    from modelhost.models.kernels.packed import PackedWeight

BF16_PANEL_ROWS = 512
BF16_SLICE_OUTPUTS = 512
_buffers = threading.local()


def bf16_matmul(
    kernels: native.Kernels, parts: list[PackedWeight], rows: torch.Tensor, y: torch.Tensor
) -> None:
    """y = rows @ W.T for W the parts side by side (rows [n, padded] fp32, y [n, outputs])."""
    n, width = rows.shape
    panels = -(-n // BF16_PANEL_ROWS)
    x = torch.zeros((panels * BF16_PANEL_ROWS, width), dtype=torch.bfloat16)
    x[:n] = rows
    column = 0
    for part in parts:
        for first in range(0, part.out, BF16_SLICE_OUTPUTS):
            count = min(BF16_SLICE_OUTPUTS, part.out - first)
            weight = _buffer(count * part.padded).view(count, part.padded)
            kernels.dequantize_bf16(part.desc, first, weight)
            columns = slice(column + first, column + first + count)
            for start in range(0, n, BF16_PANEL_ROWS):
                stop = min(n, start + BF16_PANEL_ROWS)
                panel = x[start : start + BF16_PANEL_ROWS] @ weight.t()
                y[start:stop, columns] = panel[: stop - start]
        column += part.out


def _buffer(elements: int) -> torch.Tensor:
    """This thread's bf16 buffer of at least `elements`, first `elements` of it."""
    buffer = getattr(_buffers, "buffer", None)
    if buffer is None or buffer.numel() < elements:
        buffer = torch.empty(elements, dtype=torch.bfloat16)
        _buffers.buffer = buffer
    return buffer[:elements]
