"""Weights in the native kernels' packed form, and the modules that compute with them.

A `PackedWeight` is one [out, width] matrix in the quantization of the file it came from,
repacked losslessly into the tiles of native_qlinear.h: the GGUF types Q4_0, Q4_1, Q5_0, Q5_1,
Q8_0, Q2_K, Q3_K, Q4_K, Q5_K and Q6_K, and float tiles for F32, F16 and BF16. Each costs
about the bytes of its file (Q4_K: 4.625 bits a weight against the file's 4.5; Q6_K 6.625
against 6.5625), and every token, a prompt's or a generated one, runs through the same
kernel: its activations rounded to 16 bits, the weights' integer levels multiplied exactly.
Prompt rows and generated rows therefore take the same path, and a row's result never
depends on the rows beside it.

The one exception is asked for (`--prompt-activations 8` or `bf16`): a step's `coarse_rows`,
prompt tokens whose logits nobody reads (engine/runner.py marks them: those before a long
prompt's last block), run either with their activations rounded to 8 bits each 32 inputs, as
llama.cpp's, which does half the integer products, or through PyTorch's bf16 GEMM over the
weight dequantized to bf16 a slice of outputs at a time (bf16_linear.py): on a CPU with AMX
oneDNN multiplies bf16 on its tiles several times faster than the integer kernels. Their keys
and values then differ a little from a 16-bit prompt's; sampled rows (decode, a prompt's last
token, speculation's verification) stay at 16 bits, and a row's result still depends only on
the row.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import nn

from modelhost.models.kernels import native
from modelhost.models.kernels.bf16_linear import bf16_matmul
from modelhost.models.kernels.structs import QLinearDesc
from modelhost.models.loading.footprint import TYPE_NAMES, padded_width


class PackedWeight:
    """One packed [out, width] weight: three byte arrays the kernels read in place."""

    def __init__(self, format: int, out: int, width: int, arrays: tuple[torch.Tensor, ...]):
        self.format, self.out, self.width = format, out, width
        self.data, self.params, self.supers = arrays
        self.padded = padded_width(width)
        self.desc = QLinearDesc(
            format=format,
            data=self.data.data_ptr(),
            params=self.params.data_ptr(),
            supers=self.supers.data_ptr(),
            out=out,
            padded=self.padded,
        )

    @classmethod
    def repack(
        cls,
        kernels: native.Kernels,
        format: int,
        source: int,
        out: int,
        width: int,
        order: torch.Tensor | None = None,
    ) -> PackedWeight:
        """Repacks the row-major [out, width] GGUF tensor of type `format` at address `source`
        (its bytes must stay alive during the call); row r is the source's row order[r]."""
        weight, (arrays,) = cls.empty(kernels, format, [out], width)
        kernels.repack(format, source, out, width, order, arrays)
        return weight

    @classmethod
    def empty(
        cls, kernels: native.Kernels, format: int, outs: list[int], width: int
    ) -> tuple[PackedWeight, list[tuple[torch.Tensor, ...]]]:
        """An unfilled weight of parts with `outs` outputs side by side, and each part's slice
        of its arrays to repack into. Every part but the last fills whole blocks of 16
        outputs (so the parts' blocks follow each other)."""
        if any(out % 16 for out in outs[:-1]):
            raise ValueError("only the last part may end inside a block of 16 outputs")
        sizes = []
        for out in outs:
            part = kernels.packed_sizes(format, out, width)
            if part is None:
                name = TYPE_NAMES.get(format, format)
                raise ValueError(f"{name} cannot hold a width of {width}")
            sizes.append(part)
        # 64-byte aligned: the kernels load whole cache lines of tiles.
        arrays = tuple(_aligned_bytes(sum(part[i] for part in sizes)) for i in range(3))
        slices, offsets = [], [0, 0, 0]
        for part in sizes:
            slices.append(tuple(a[offsets[i] : offsets[i] + part[i]] for i, a in enumerate(arrays)))
            offsets = [offsets[i] + part[i] for i in range(3)]
        return cls(format, sum(outs), width, arrays), slices

    @property
    def nbytes(self) -> int:
        return sum(a.numel() for a in (self.data, self.params, self.supers))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.data, self.params, self.supers

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight, dequantized: [*ids.shape, width] fp32."""
        kernels = _kernels()
        values = kernels.qrows(self.desc, ids.reshape(-1))
        if self.padded != self.width:
            values = values[:, : self.width].contiguous()
        return values.view(*ids.shape, self.width)

    def dequantize(self) -> torch.Tensor:
        """The whole weight in fp32, [out, width] (tests, and small weights)."""
        return self.rows(torch.arange(self.out))


# The step's tokens (all of its T rows) whose activations may be coarse: [T] bool, and whether
# they take bf16 (else 8-bit activations); or None.
_coarse_rows: ContextVar[tuple[torch.Tensor, bool] | None] = ContextVar("coarse_rows", default=None)


@contextmanager
def coarse_rows(mask: torch.Tensor | None, bf16: bool = False) -> Iterator[None]:
    """Within it, a QuantLinear given the step's T rows (mask [T] bool) computes the rows
    marked True with 8-bit activations, or with `bf16` in bf16 (activations, weights and
    outputs rounded to bf16, fp32 sums); inputs of another row count (the last layer's kept
    tokens, the LM head: the rows whose logits are wanted) stay at 16 bits."""
    marked = mask is not None and bool(mask.any())
    token = _coarse_rows.set((mask, bf16) if marked and mask is not None else None)
    try:
        yield
    finally:
        _coarse_rows.reset(token)


class QuantLinear(nn.Module):
    """y = x @ W.T + bias for W one or more packed weights whose outputs sit side by side
    (fused q/k/v, or gate/up, where their formats differ)."""

    def __init__(self, parts: list[PackedWeight], bias: torch.Tensor | None) -> None:
        super().__init__()
        self.parts = parts
        for index, part in enumerate(parts):
            for name, tensor in zip(("data", "params", "supers"), part.tensors(), strict=True):
                self.register_buffer(f"part{index}_{name}", tensor, persistent=False)
        self.bias: torch.Tensor | None
        self.register_buffer("bias", bias, persistent=False)
        self.in_features = parts[0].width
        self.out_features = sum(part.out for part in parts)
        self.padded = parts[0].padded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = _kernels()
        shape = x.shape
        rows = native.padded_rows(x.reshape(-1, shape[-1]), self.padded)
        y = torch.empty((rows.shape[0], self.out_features), dtype=torch.float32)
        coarse = _coarse_rows.get()
        if coarse is not None and coarse[0].shape[0] == rows.shape[0]:
            self._mixed(kernels, rows, coarse[0], coarse[1], y)
        else:
            self._matmul(kernels, rows, y, coarse=False)
        if self.bias is not None:
            y += self.bias
        return y.view(*shape[:-1], self.out_features)

    def _matmul(
        self, kernels: native.Kernels, rows: torch.Tensor, y: torch.Tensor, coarse: bool
    ) -> None:
        column = 0
        for part in self.parts:
            kernels.qmatmul(rows, part.desc, y, column, coarse=coarse)
            column += part.out

    def _mixed(
        self,
        kernels: native.Kernels,
        rows: torch.Tensor,
        coarse: torch.Tensor,
        bf16: bool,
        y: torch.Tensor,
    ) -> None:
        """The coarse rows at 8 bits (or bf16), the others at 16: each row's result is the one
        it gets alone (rows never depend on each other), so the two sets are computed apart."""

        def coarse_matmul(x: torch.Tensor, out: torch.Tensor) -> None:
            if bf16:
                bf16_matmul(kernels, self.parts, x, out)
            else:
                self._matmul(kernels, x, out, coarse=True)

        if bool(coarse.all()):
            coarse_matmul(rows, y)
            return
        for wanted, is_coarse in ((coarse, True), (~coarse, False)):
            index = wanted.nonzero().view(-1)
            part = torch.empty((index.numel(), y.shape[1]), dtype=torch.float32)
            selected = rows.index_select(0, index).contiguous()
            if is_coarse:
                coarse_matmul(selected, part)
            else:
                self._matmul(kernels, selected, part, coarse=False)
            y.index_copy_(0, index, part)


class PackedEmbedding(nn.Module):
    """Token embeddings looked up from a packed table (shared with a tied LM head)."""

    def __init__(self, weight: PackedWeight) -> None:
        super().__init__()
        self.weight_packed = weight
        for name, tensor in zip(("data", "params", "supers"), weight.tensors(), strict=True):
            self.register_buffer(f"table_{name}", tensor, persistent=False)
        self.num_embeddings, self.embedding_dim = weight.out, weight.width

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight_packed.rows(ids)


def _kernels() -> native.Kernels:
    kernels = native.kernels()
    if kernels is None:  # packed weights are only ever built with the kernels present
        raise RuntimeError("packed weights need the native kernels")
    return kernels


def _aligned_bytes(size: int) -> torch.Tensor:
    """An uninitialised uint8 tensor of `size` bytes starting on a 64-byte boundary."""
    storage = torch.empty(size + 64, dtype=torch.uint8)
    offset = (-storage.data_ptr()) % 64
    return storage[offset : offset + size]
