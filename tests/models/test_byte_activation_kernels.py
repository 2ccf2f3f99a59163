"""8-bit activations for prompt rows whose logits nobody reads (--prompt-activations 8): the
native matmul's byte path (models/kernels/native_qlinear.h) and QuantLinear's coarse rows
(models/kernels/packed.py)."""

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


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).abs().max() / expected.abs().max()).item()


def packed_tensor(qtype, out: int, width: int, seed: int = 0):
    raw = random_tensor(qtype, out, width, seed)
    expected = torch.from_numpy(np.array(dequantize(raw, qtype), dtype=np.float32))
    weight = PackedWeight.repack(kernels, int(qtype), raw.ctypes.data, out, width)
    return weight, expected.reshape(out, width)


def matmul(x: torch.Tensor, weight: PackedWeight, coarse: bool) -> torch.Tensor:
    y = torch.empty(x.shape[0], weight.out)
    kernels.qmatmul(native.padded_rows(x, weight.padded), weight.desc, y, 0, coarse=coarse)
    return y


def byte_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the byte path rounds it: each 32 inputs to int8 times their largest / 127."""
    groups = x.reshape(x.shape[0], -1, 32)
    largest = groups.abs().amax(dim=-1, keepdim=True)
    levels = (groups * (torch.full_like(largest, 127.0) / largest)).round()
    return (levels * (largest / 127)).reshape(x.shape)


@pytest.mark.parametrize("qtype", LEGACY + K_TYPES, ids=lambda t: t.name)
def test_an_eight_bit_matmul_is_the_exact_weight_times_the_byte_rounded_activations(qtype):
    weight, expected = packed_tensor(qtype, 80, 768)
    x = torch.randn(11, 768)  # a tile of 8 rows, then 3
    got = matmul(x, weight, coarse=True)
    # Integer products exact, each group's scales applied in fp32: a few ulps of the result.
    assert relative_error(got, byte_activations(x) @ expected.t()) < 1e-5
    # 8 bits a group: within 1% of fp32's product (the 16-bit rows: 1e-4), on random data.
    assert relative_error(got, x @ expected.t()) < 1e-2
    assert relative_error(matmul(x, weight, coarse=False), x @ expected.t()) < 1e-4


@pytest.mark.parametrize("qtype", FLOATS, ids=lambda t: t.name)
def test_float_weights_ignore_the_eight_bit_request(qtype):
    weight, _ = packed_tensor(qtype, 48, 256)
    x = torch.randn(5, 256)
    assert torch.equal(matmul(x, weight, coarse=True), matmul(x, weight, coarse=False))


def test_a_group_with_an_outlier_rounds_only_its_own_32_inputs_coarsely():
    weight, expected = packed_tensor(T.Q4_K, 32, 256)
    x = torch.randn(2, 256)
    x[:, 3] = 300.0  # group 0's scale; the other seven groups keep their own
    got = matmul(x, weight, coarse=True)
    assert relative_error(got, byte_activations(x) @ expected.t()) < 1e-5
    assert byte_activations(x)[:, 32:].sub(x[:, 32:]).abs().max() < 0.05


def test_a_row_of_zeros_gives_zeros_at_eight_bits():
    weight, _ = packed_tensor(T.Q6_K, 32, 256)
    assert torch.equal(matmul(torch.zeros(2, 256), weight, coarse=True), torch.zeros(2, 32))


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0, T.Q2_K], ids=lambda t: t.name)
def test_an_eight_bit_rows_result_does_not_depend_on_the_rows_beside_it(qtype):
    weight, _ = packed_tensor(qtype, 64, 256)
    x = torch.randn(11, 256)
    together = matmul(x, weight, coarse=True)
    for row in range(11):
        assert torch.equal(matmul(x[row : row + 1], weight, coarse=True)[0], together[row])


def test_quant_linear_computes_coarse_rows_at_eight_bits_and_the_others_at_sixteen():
    first, _ = packed_tensor(T.Q4_K, 32, 256, seed=1)
    second, _ = packed_tensor(T.Q6_K, 48, 256, seed=2)  # two parts side by side (q/k/v)
    linear = QuantLinear([first, second], bias=None)
    x = torch.randn(9, 256)
    mask = torch.tensor([True, False, True, True, False, True, True, True, False])
    fine, coarse = linear(x), None
    with coarse_rows(torch.ones(9, dtype=torch.bool)):
        coarse = linear(x)
    with coarse_rows(mask):
        mixed = linear(x)
        fewer_rows = linear(x[:4])  # not the step's rows (the kept ones): 16 bits
    assert not torch.equal(coarse, fine)
    assert torch.equal(mixed[mask], coarse[mask])
    assert torch.equal(mixed[~mask], fine[~mask])
    assert torch.equal(fewer_rows, fine[:4])
    assert torch.equal(linear(x), fine)  # outside the context: 16 bits again
