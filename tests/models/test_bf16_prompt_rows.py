"""bf16 rows for long prompts' tokens whose logits nobody reads (--prompt-activations bf16): the
weights dequantized to bf16 (models/kernels/native_bf16.h) and QuantLinear's bf16 coarse rows
through PyTorch's bf16 GEMM (models/kernels/packed.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.quants import dequantize
from gguf_blocks import FLOATS, K_TYPES, LEGACY, T, random_tensor

from modelhost.models.kernels import native
from modelhost.models.kernels.packed import PackedWeight, QuantLinear, coarse_rows

kernels = native.kernels()
pytestmark = pytest.mark.skipif(
    kernels is None, reason="no g++, or neither AVX-512 VNNI nor AVX2 here"
)


def packed_tensor(qtype, out: int, width: int, seed: int = 0):
    raw = random_tensor(qtype, out, width, seed)
    expected = torch.from_numpy(np.array(dequantize(raw, qtype), dtype=np.float32))
    weight = PackedWeight.repack(kernels, int(qtype), raw.ctypes.data, out, width)
    return weight, expected.reshape(out, width)


def bf16_rows(weight: PackedWeight, first: int, count: int) -> torch.Tensor:
    out = torch.full((count, weight.padded), float("nan"), dtype=torch.bfloat16)
    kernels.dequantize_bf16(weight.desc, first, out)
    return out


@pytest.mark.parametrize("qtype", LEGACY + K_TYPES + FLOATS, ids=lambda t: t.name)
def test_a_weight_in_bf16_is_its_files_values_rounded_to_bf16(qtype):
    width = 256 if qtype in K_TYPES else 320  # 320: inputs padded to 384
    weight, expected = packed_tensor(qtype, 40, width)  # 2.5 blocks of 16 outputs
    got = bf16_rows(weight, 0, 40)
    # One rounding to bf16 (8 bits of mantissa): within half an ulp, 2^-9 of the value.
    assert (got[:, :width].float() - expected).abs().le(expected.abs() * 2**-8).all()
    assert torch.equal(got[:, width:].float(), torch.zeros(40, weight.padded - width))


def test_a_slice_of_a_weights_outputs_in_bf16_is_those_rows_of_the_whole():
    weight, _ = packed_tensor(T.Q4_K, 80, 256)
    whole = bf16_rows(weight, 0, 80)
    assert torch.equal(bf16_rows(weight, 32, 40), whole[32:72])


def test_quant_linear_computes_bf16_coarse_rows_near_fp32_and_the_others_at_sixteen_bits():
    first, expected_first = packed_tensor(T.Q4_K, 32, 256, seed=1)
    second, expected_second = packed_tensor(T.Q6_K, 48, 256, seed=2)  # two parts (q/k/v)
    linear = QuantLinear([first, second], bias=None)
    expected = torch.cat([expected_first, expected_second])
    x = torch.randn(9, 256)
    mask = torch.tensor([True, False, True, True, False, True, True, True, False])
    fine = linear(x)
    with coarse_rows(mask, bf16=True):
        mixed = linear(x)
    exact = x @ expected.t()
    error = (mixed[mask] - exact[mask]).norm() / exact[mask].norm()
    assert 0 < error < 1e-2  # bf16 activations, weights and outputs: about 0.3% on random data
    assert torch.equal(mixed[~mask], fine[~mask])


def test_a_bf16_rows_result_does_not_depend_on_the_rows_beside_it():
    weight, _ = packed_tensor(T.Q4_K, 600, 256)  # two slices of outputs
    linear = QuantLinear([weight], bias=None)
    x = torch.randn(530, 256)  # two panels of rows

    def bf16(rows: torch.Tensor) -> torch.Tensor:
        with coarse_rows(torch.ones(rows.shape[0], dtype=torch.bool), bf16=True):
            return linear(rows)

    together = bf16(x)
    order = torch.randperm(530)
    assert torch.equal(bf16(x[order]), together[order])
    assert torch.equal(bf16(x[7:40]), together[7:40])
