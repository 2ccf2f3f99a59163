"""The native kernels (models/kernels/native.py): packed matmuls of every GGUF type, attention,
norms, activations and token choice."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize
from gguf_blocks import ALL_TYPES, FLOATS, K_TYPES, LEGACY, T, random_tensor

from modelhost.models.kernels import native
from modelhost.models.kernels.packed import PackedWeight
from modelhost.models.networks import layers
from modelhost.models.networks.layers import Rotary, apply_rotary_

kernels = native.kernels()
pytestmark = pytest.mark.skipif(
    kernels is None, reason="no g++, or neither AVX-512 VNNI nor AVX2 here"
)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).abs().max() / expected.abs().max()).item()


def packed_tensor(qtype, out: int, width: int, seed: int = 0, order=None):
    """A random GGUF tensor of `qtype`, packed, and gguf's own dequantization of it (rows in
    `order`)."""
    raw = random_tensor(qtype, out, width, seed)
    expected = torch.from_numpy(np.array(dequantize(raw, qtype), dtype=np.float32))
    expected = expected.reshape(out, width)
    weight = PackedWeight.repack(kernels, int(qtype), raw.ctypes.data, out, width, order)
    return weight, expected if order is None else expected[order]


def matmul(x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    y = torch.empty(x.shape[0], weight.out)
    kernels.qmatmul(native.padded_rows(x, weight.padded), weight.desc, y, 0)
    return y


def rounded_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels round it: per row, (high + low / 256) * (largest / 127) with int8 high
    and low."""
    largest = x.abs().amax(dim=-1, keepdim=True)
    # A tensor divided by a tensor, as the kernel divides: `127.0 / largest` (a scalar over a
    # tensor) can be an ulp off, and then a low half near .5 rounds the other way.
    scaled = x * (torch.full_like(largest, 127.0) / largest)
    high = scaled.round()
    low = ((scaled - high) * 256).round().clamp(-127, 127)
    return (high + low / 256) * (largest / 127)


# 83 outputs: the last block of 16 mostly padding; rows in a shuffled order, as the loader
# undoes llama.cpp's permutation of q and k rows.
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_every_gguf_type_repacks_to_exactly_the_values_gguf_dequantizes(qtype):
    order = torch.randperm(83, generator=torch.Generator().manual_seed(1))
    weight, expected = packed_tensor(qtype, 83, 512, order=order)
    assert torch.equal(weight.dequantize(), expected)


@pytest.mark.parametrize("qtype", LEGACY + FLOATS, ids=lambda t: t.name)
def test_widths_that_are_not_a_multiple_of_64_are_padded_with_zeros(qtype):
    weight, expected = packed_tensor(qtype, 40, 96)
    assert torch.equal(weight.dequantize(), expected)
    x = torch.randn(3, 96)
    assert relative_error(matmul(x, weight), x @ expected.t()) < 1e-4


@pytest.mark.parametrize("qtype", LEGACY + K_TYPES, ids=lambda t: t.name)
def test_a_quantized_matmul_is_the_exact_weight_times_the_rounded_activations(qtype):
    weight, expected = packed_tensor(qtype, 80, 768)
    x = torch.randn(11, 768)  # a tile of 8 rows, then 3
    got = matmul(x, weight)
    # Each level times the rounded activation; each group's minimum times the exact sum.
    assert relative_error(got, rounded_activations(x) @ expected.t()) < 1e-3
    assert relative_error(got, x @ expected.t()) < 1e-3  # 16 bits: near fp32's product


@pytest.mark.parametrize("qtype", FLOATS, ids=lambda t: t.name)
def test_a_float_matmul_multiplies_fp32_activations_by_the_stored_weights(qtype):
    weight, expected = packed_tensor(qtype, 80, 256)
    x = torch.randn(5, 256)
    assert torch.allclose(matmul(x, weight), x @ expected.t(), rtol=1e-5, atol=1e-6)


def test_a_width_the_type_cannot_hold_is_refused():
    raw = random_tensor(T.Q8_0, 16, 128)  # valid Q8_0; Q4_K blocks span 256 weights
    with pytest.raises(ValueError, match="Q4_K cannot hold a width of 128"):
        PackedWeight.repack(kernels, int(T.Q4_K), raw.ctypes.data, 16, 128)


def test_eight_bit_levels_at_the_extremes_multiply_exactly():
    # Levels of +-127 against inputs at the row's largest magnitude: on AVX2 a pair of such
    # byte products overflows int16 unless the levels are split into nibbles.
    weights = np.full((32, 128), 0.5 * 127, dtype=np.float32)
    weights[16:] *= -1
    weights[8:24, ::3] *= -1
    raw = np.ascontiguousarray(quantize(weights, T.Q8_0))
    weight = PackedWeight.repack(kernels, int(T.Q8_0), raw.ctypes.data, 32, 128)
    x = torch.ones(3, 128)
    x[1] = -1.0
    x[2, ::2] = -1.0
    assert torch.equal(matmul(x, weight), x @ torch.from_numpy(weights).t())


def test_rounding_keeps_16_bits_of_a_row_with_an_outlier():
    weight, expected = packed_tensor(T.Q4_1, 80, 128)
    x = torch.randn(2, 128)
    x[:, 3] = 300.0  # one int8 alone would round the rest of the row to a level or two
    assert relative_error(matmul(x, weight), x @ expected.t()) < 1e-3


def test_a_row_of_zeros_gives_zeros():
    weight, _ = packed_tensor(T.Q4_K, 32, 256)
    assert torch.equal(matmul(torch.zeros(2, 256), weight), torch.zeros(2, 32))


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0, T.BF16], ids=lambda t: t.name)
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(qtype):
    weight, _ = packed_tensor(qtype, 64, 256)
    x = torch.randn(11, 256)  # a tile of 8, then 3
    together = matmul(x, weight)
    for row in range(11):
        assert torch.equal(matmul(x[row : row + 1], weight)[0], together[row])


def test_results_do_not_depend_on_the_thread_count(monkeypatch):
    weight, _ = packed_tensor(T.Q5_K, 200, 256)
    x = torch.randn(3, 256)
    monkeypatch.setattr(kernels, "threads", 1)
    alone = matmul(x, weight)
    monkeypatch.setattr(kernels, "threads", 2)
    assert torch.equal(matmul(x, weight), alone)


_AVX2_CHECK = """
import sys, torch
sys.path.insert(0, "tests")
from gguf_blocks import ALL_TYPES, random_tensor
from modelhost.models.kernels import native
from modelhost.models.kernels.packed import PackedWeight
kernels = native.kernels()
torch.manual_seed(0)
x = torch.randn(11, 512)
for qtype in ALL_TYPES:
    raw = random_tensor(qtype, 48, 512)
    weight = PackedWeight.repack(kernels, int(qtype), raw.ctypes.data, 48, 512)
    for coarse in (False, True):  # 16-bit rows, and a prompt's rows rounded to 8 bits
        y = torch.empty(11, 48)
        kernels.qmatmul(x, weight.desc, y, 0, coarse=coarse)
        torch.save(y, f"{sys.argv[1]}/{qtype.name}{'-8bit' if coarse else ''}.pt")
"""


@pytest.mark.skipif(not native.avx512_vnni(), reason="this CPU runs the AVX2 build already")
def test_the_avx2_build_computes_what_the_avx512_build_does_at_16_and_8_bits(tmp_path):
    results = {}
    for variant in ("avx512", "avx2"):
        folder = tmp_path / variant
        folder.mkdir()
        env = {**os.environ, "MODELHOST_NATIVE": variant}
        subprocess.run(
            [sys.executable, "-c", _AVX2_CHECK, str(folder)], env=env, check=True, timeout=600
        )
        results[variant] = {path.stem: torch.load(path) for path in folder.glob("*.pt")}
    names = {f"{t.name}{bits}" for t in ALL_TYPES for bits in ("", "-8bit")}
    assert results["avx2"].keys() == results["avx512"].keys() == names
    for name, expected in results["avx512"].items():
        # Integer products are exact on both; only the order of fp32 sums may differ.
        assert relative_error(results["avx2"][name], expected) < 1e-6, name


def reference_attention(qkv, heads, kv_heads, norm, rope, keys, values, positions, window, scale):
    """The same step the unfused way: q/k norms, rotary, softmax over each row's keys."""
    rows, dim = qkv.shape[0], keys.shape[-1]
    qk = qkv[:, : (heads + kv_heads) * dim].reshape(rows, heads + kv_heads, dim).clone()
    if norm is not None:
        qk = torch.rms_norm(qk, (dim,), None, norm[1]) * norm[0]
    apply_rotary_(qk, *rope)
    out = []
    for r in range(rows):
        position = int(positions[r])
        first = max(0, position - window + 1) if window else 0
        k = torch.cat((keys[r, :position], qk[r, heads:][None]))[first:]  # [L, Hkv, D]
        v = torch.cat((values[r, :position], qkv[r, (heads + kv_heads) * dim :].view(1, -1, dim)))
        v = v[first:]
        q = qk[r, :heads].view(kv_heads, heads // kv_heads, dim)
        scores = torch.einsum("hgd,lhd->hgl", q, k) * scale
        out.append(torch.einsum("hgl,lhd->hgd", scores.softmax(-1), v).reshape(-1))
    return torch.stack(out)


# Query heads per KV head: 3; 10 (a group of 8, then 2; 3 chunks of 16 in passes of 2);
# 1 (all 4 chunks in one pass). Up to 40 keys: two blocks of 16 keys and a part block.
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(6, 2, 32), (10, 1, 48), (4, 4, 64)])
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("cached", [torch.float32, torch.float16])
def test_paged_attention_of_one_query_a_row_matches_the_unfused_computation(
    heads, kv_heads, dim, window, qk_norm, cached
):
    torch.manual_seed(0)
    block_size, length = 4, 40
    positions = torch.tensor([0, 39, 3, 17])  # each row's new token
    rows, blocks_per_row = len(positions), length // block_size
    pool = torch.zeros((1 + rows * blocks_per_row) * block_size, 2, kv_heads, dim, dtype=cached)
    # Row r owns blocks scattered through the pool (block 0 is the padding block).
    tables = torch.tensor([[1 + r + rows * j for j in range(blocks_per_row)] for r in range(rows)])
    # As the pool holds them (an fp16 pool rounds what it stores).
    keys = torch.randn(rows, length, kv_heads, dim).to(cached).float()
    values = torch.randn(rows, length, kv_heads, dim).to(cached).float()
    at = torch.arange(length)
    slot = tables[:, at // block_size] * block_size + at % block_size
    for r in range(rows):
        pool[slot[r], 0], pool[slot[r], 1] = keys[r].to(cached), values[r].to(cached)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim)
    norm = (torch.rand(heads + kv_heads, dim) + 0.5, 1e-6) if qk_norm else None
    cos, sin = Rotary(dim, 10_000.0).cos_sin(positions, torch.float32)
    expected = reference_attention(
        qkv, heads, kv_heads, norm, (cos, sin), keys, values, positions, window, 0.2
    )
    slots = slot[torch.arange(rows), positions]
    work = qkv.clone()  # normed and rotated in place
    got = kernels.paged_attention(
        work, heads, kv_heads, norm, (cos, sin), pool, slots, tables, block_size, positions,
        window, 0.2,
    )  # fmt: skip
    # fp16: the new token's own key and value are attended as stored, rounded.
    assert torch.allclose(got, expected, atol=1e-5 if cached == torch.float32 else 2e-3)
    # The new key (rotated) and value are in the pool, at each row's slot.
    key_part = slice(heads * dim, (heads + kv_heads) * dim)
    assert torch.equal(pool[slots, 0].reshape(rows, -1), work[:, key_part].to(cached))
    assert torch.equal(pool[slots, 1].reshape(rows, -1), qkv[:, key_part.stop :].to(cached))


@pytest.mark.parametrize("rows", [3, 300])  # a decode step's rows; a prompt's, threaded
def test_rms_norm_is_torchs(rows):
    torch.manual_seed(0)
    x, weight = torch.randn(rows, 72), torch.rand(72)  # 72: a partial vector at the end
    expected = torch.rms_norm(x, (72,), weight, 1e-6)
    assert torch.allclose(kernels.rms_norm(x, weight, 1e-6), expected, atol=1e-6)


@pytest.mark.parametrize("rows", [3, 300])
@pytest.mark.parametrize("name", ["silu", "gelu_tanh"])
def test_gated_activation_is_the_activated_gate_times_up(name, rows):
    torch.manual_seed(0)
    gate_up = torch.randn(rows, 2 * 40) * 4
    gate, up = gate_up.split(40, dim=-1)
    act = torch.nn.functional.silu if name == "silu" else layers.gelu_tanh
    got = kernels.gated_activation(gate_up, native.ACTIVATIONS[name])
    assert torch.allclose(got, act(gate) * up, atol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_choose_tokens_draws_over_a_large_vocabulary_where_the_exact_cdf_puts_the_uniform(
    temperature: float,
):
    torch.manual_seed(0)
    logits = torch.randn(3, 262_144) * 3
    logits[1, 1000:200_000] = float("-inf")  # whole blocks filtered
    logits[2, :] = float("-inf")
    logits[2, 123_456] = 0.0  # one token left
    cdf = torch.softmax(logits.double() / temperature, dim=-1).cumsum(dim=-1)
    for _ in range(50):
        uniforms = torch.rand(3)
        chosen = kernels.choose_tokens(logits, uniforms, torch.full((3,), temperature))
        assert chosen[2] == 123_456
        for row in range(2):
            token = chosen[row].item()
            assert logits[row, token] > float("-inf")
            below = cdf[row, token - 1].item() if token > 0 else 0.0
            # fp32 sums of 262,144 terms: the chosen token's CDF interval holds u up to rounding
            assert below - 1e-5 <= uniforms[row].item() <= cdf[row, token].item() + 1e-5


def test_choose_tokens_without_uniforms_is_torchs_argmax():
    torch.manual_seed(0)
    logits = torch.randn(5, 262_144)
    logits[2, 7] = logits[2, 9] = logits[2].max() + 1  # a tie: the first index wins
    assert torch.equal(kernels.choose_tokens(logits, None), logits.argmax(dim=-1))


@pytest.mark.parametrize("temperature", [None, 0.5, 3.0])  # None: no temperatures given, 1
def test_choose_tokens_draws_in_proportion_to_the_softmax_and_never_a_filtered_token(
    temperature: float | None,
):
    logits = torch.tensor([[0.0, 1.0, 2.0, float("-inf"), 0.5]])
    draws = 20_000
    uniforms = torch.rand(draws)
    temperatures = None if temperature is None else torch.tensor([temperature])
    chosen = torch.cat(
        [kernels.choose_tokens(logits, uniforms[i : i + 1], temperatures) for i in range(draws)]
    )
    frequency = torch.bincount(chosen, minlength=5).float() / draws
    assert frequency[3] == 0
    expected = torch.softmax(logits / (temperature or 1.0), dim=-1)[0]
    assert torch.allclose(frequency, expected, atol=0.015)
