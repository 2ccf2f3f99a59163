"""The native kernels (models/native.py): int4/int8 matmuls and decode attention."""

from __future__ import annotations

import pytest
import torch

from modelhost.models import layers, native, quant
from modelhost.models.layers import Rotary, apply_rotary_

kernels = native.kernels()
pytestmark = pytest.mark.skipif(
    kernels is None, reason="no g++, or neither AVX-512 VNNI nor AVX2 here"
)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).abs().max() / expected.abs().max()).item()


def int4_operands(out: int, width: int) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """A random weight's int4 form, dequantized, and the kernel's packed operands."""
    q, scales, mins = quant.quantize_int4(torch.randn(out, width), search=False)
    scales, mins = native.int4_params(scales, mins)
    dequantized = (q.float() * scales[..., None] + mins[..., None]).reshape(out, width)
    return dequantized, (*native.pack_int4(q, scales, mins), out)


def rounded_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the int4/int8 kernels round it: per row, (high + low / 256) * (largest / 127)
    with int8 high and low."""
    largest = x.abs().amax(dim=-1, keepdim=True)
    # A tensor divided by a tensor, as the kernel divides: `127.0 / largest` (a scalar over a
    # tensor) can be an ulp off, and then a low half near .5 rounds the other way.
    scaled = x * (torch.full_like(largest, 127.0) / largest)
    high = scaled.round()
    low = ((scaled - high) * 256).round().clamp(-127, 127)
    return (high + low / 256) * (largest / 127)


# 96 inputs: a run of 64 half padding; 83 outputs: the last block of 16 mostly padding.
@pytest.mark.parametrize(("out", "width"), [(80, 128), (83, 96), (80, 576)])
def test_int4_matmul_is_the_dequantized_weight_times_the_rounded_activations(out, width):
    torch.manual_seed(0)
    q, scales, mins = quant.quantize_int4(torch.randn(out, width), search=False)
    scales, mins = native.int4_params(scales, mins)
    x = torch.randn(6, width)
    got = kernels.int4_matmul(x, *native.pack_int4(q, scales, mins), out)
    # The levels times the rounded activations; the mins times the exact sums of each group.
    levels = (q.float() * scales[..., None]).reshape(out, width)
    group_sums = x.reshape(6, -1, 32).sum(dim=-1)
    expected = rounded_activations(x) @ levels.t() + group_sums @ mins.t()
    assert relative_error(got, expected) < 1e-5
    dequantized = levels + mins.repeat_interleave(32, dim=1)
    assert relative_error(got, x @ dequantized.t()) < 1e-4  # 16 bits: near fp32's product


@pytest.mark.parametrize(("out", "width"), [(80, 96), (83, 640)])
def test_int8_matmul_is_the_dequantized_weight_times_the_rounded_activations(out, width):
    torch.manual_seed(0)
    weight = torch.randn(out, width)
    scales = weight.abs().amax(dim=1) / 127
    q = torch.round(weight / scales[:, None]).to(torch.int8)
    x = torch.randn(11, width)  # a tile of 8 rows, then 3
    dequantized = q.float() * scales[:, None]
    got = kernels.int8_matmul(x, native.pack_int8(q), scales)
    assert relative_error(got, rounded_activations(x) @ dequantized.t()) < 1e-5
    assert relative_error(got, x @ dequantized.t()) < 1e-4


def test_int8_matmul_is_exact_where_every_product_is_at_the_extremes():
    # Levels of +-127 (stored as 255 and 1) against inputs at the row's largest magnitude: on
    # AVX2 a pair of such byte products overflows int16 unless the weights' top bit is split off.
    width = 128
    q = torch.full((32, width), 127, dtype=torch.int8)
    q[16:] = -127
    q[8:24, ::3] *= -1
    scales = torch.full((32,), 0.5)
    x = torch.ones(3, width)
    x[1] = -1.0
    x[2, ::2] = -1.0
    got = kernels.int8_matmul(x, native.pack_int8(q), scales)
    assert torch.equal(got, x @ (q.float() * 0.5).t())


def test_rounding_keeps_16_bits_of_a_row_with_an_outlier():
    torch.manual_seed(0)
    dequantized, operands = int4_operands(80, 128)
    x = torch.randn(2, 128)
    x[:, 3] = 300.0  # one int8 alone would round the rest of the row to a level or two
    assert relative_error(kernels.int4_matmul(x, *operands), x @ dequantized.t()) < 1e-3


def test_a_row_of_zeros_gives_zeros():
    _, operands = int4_operands(32, 64)
    assert torch.equal(kernels.int4_matmul(torch.zeros(2, 64), *operands), torch.zeros(2, 32))


@pytest.mark.parametrize("bits", [4, 8])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(bits):
    torch.manual_seed(0)
    if bits == 4:
        _, operands = int4_operands(64, 128)
        matmul = kernels.int4_matmul
    else:
        q = torch.randint(-127, 128, (64, 128), dtype=torch.int8)
        operands = (native.pack_int8(q), torch.rand(64))
        matmul = kernels.int8_matmul
    x = torch.randn(11, 128)  # a tile of 8, then 3
    together = matmul(x, *operands)
    for row in range(11):
        assert torch.equal(matmul(x[row : row + 1], *operands)[0], together[row])


def test_results_do_not_depend_on_the_thread_count(monkeypatch):
    torch.manual_seed(0)
    _, operands = int4_operands(200, 128)
    x = torch.randn(3, 128)
    monkeypatch.setattr(kernels, "threads", 1)
    alone = kernels.int4_matmul(x, *operands)
    monkeypatch.setattr(kernels, "threads", 2)
    assert torch.equal(kernels.int4_matmul(x, *operands), alone)


def test_linears_fall_back_to_pytorch_kernels_without_the_native_ones(monkeypatch):
    torch.manual_seed(0)
    weight = torch.randn(64, 128)
    x = torch.randn(3, 128)
    monkeypatch.setattr(native, "kernels", lambda: None)
    for linear in (quant.Int4Linear(weight, None), quant.Int8Linear(weight, None)):
        assert linear.native is None
        got = linear(x)
        assert got.dtype == torch.bfloat16  # PyTorch's kernels compute in bf16
        assert relative_error(got.float(), x @ linear.prompt_weight_t) < 2e-2


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


@pytest.mark.parametrize("width", [96, 576, 640])  # groups of 6, 36 (padded to 40) and 40
def test_int4_ranking_is_the_product_of_int8_rounded_inputs_and_grouped_int4_weights(width):
    torch.manual_seed(0)
    weight = torch.randn(300, width)
    head = quant.Int4RankingHead(weight, kernels)
    x = torch.randn(9, width)  # a tile of 8, then 1
    x_scales = x.abs().amax(dim=1, keepdim=True) / 127
    rounded_x = torch.round(x / x_scales) * x_scales
    groups = torch.nn.functional.pad(weight, (0, 16 * head.group - width)).view(300, 16, -1)
    scales, mins = (p.float()[..., None] for p in head.params.split(16, dim=1))
    levels = ((groups - mins) / scales).round().clamp(0, 15)
    rounded_weight = (levels * scales + mins).view(300, -1)[:, :width]
    expected = rounded_x @ rounded_weight.t()
    assert relative_error(head(x), expected) < 1e-5
    assert relative_error(head(x), x @ weight.t()) < 0.1  # close enough to rank


def test_int4_ranking_of_a_row_does_not_depend_on_the_rows_beside_it():
    torch.manual_seed(0)
    head = quant.Int4RankingHead(torch.randn(64, 128), kernels)
    x = torch.randn(11, 128)
    together = head(x)
    for row in range(11):
        assert torch.equal(head(x[row : row + 1])[0], together[row])


@pytest.mark.parametrize("rows", [1, 11])  # one row; a tile of 8 and a tail of 3
def test_int4_ranking_reports_the_largest_of_every_16_logits(rows):
    torch.manual_seed(0)
    head = quant.Int4RankingHead(torch.randn(1000, 128), kernels)  # 1000: a last run of 8
    logits, maxima = head.rank(torch.randn(rows, 128))
    expected = torch.nn.functional.pad(logits, (0, 8), value=float("-inf"))
    assert torch.equal(maxima, expected.view(rows, -1, 16).amax(dim=-1))


def test_top_candidates_from_the_rankings_maxima_are_those_found_without_them():
    torch.manual_seed(0)
    head = quant.Int4RankingHead(torch.randn(49_152, 64), kernels)
    logits, maxima = head.rank(torch.randn(5, 64))
    got = kernels.top_candidates(logits, 256, maxima).sort(dim=-1).values
    assert torch.equal(got, kernels.top_candidates(logits, 256).sort(dim=-1).values)
    assert torch.equal(got, logits.topk(256).indices.sort(dim=-1).values)


# Fewer blocks than k; SmolLM2's and Gemma 3's vocabularies with the ranking head's k; a
# vocabulary that ends in a partial run of 16 (and a partial block).
@pytest.mark.parametrize(("n", "k"), [(1000, 128), (49_152, 256), (262_144, 256), (100_003, 256)])
def test_top_candidates_are_the_indices_of_the_largest_scores(n, k):
    torch.manual_seed(0)
    scores = torch.randn(5, n)
    got = kernels.top_candidates(scores, k)
    expected = scores.topk(k, dim=-1).indices
    for row in range(5):
        assert sorted(got[row].tolist()) == sorted(expected[row].tolist())


def test_refine_writes_exact_dot_products_at_the_candidates_and_nothing_else():
    torch.manual_seed(0)
    x, weight = torch.randn(3, 72), torch.randn(500, 72)  # 72: a masked tail after 64
    logits = torch.full((3, 500), -7.0)
    indices = torch.stack([torch.randperm(500)[:20] for _ in range(3)])
    kernels.refine(x, weight, indices, logits)
    expected = (x @ weight.t()).gather(1, indices)
    assert torch.allclose(logits.gather(1, indices), expected, atol=1e-4)
    assert (logits == -7.0).sum() == 3 * (500 - 20)


def test_top_candidates_are_found_when_they_crowd_into_a_few_blocks():
    torch.manual_seed(0)
    scores = torch.randn(2, 262_144)
    scores[0, 5000:5300] += 50  # the best 256 all lie in two blocks of 256
    scores[1] = torch.linspace(-1, 1, 262_144)  # ascending: the best are the last 256
    got = kernels.top_candidates(scores, 256)
    for row in range(2):
        assert sorted(got[row].tolist()) == sorted(scores[row].topk(256).indices.tolist())


def test_top_candidates_are_distinct_even_when_scores_are_nan():
    scores = torch.tensor([[3.0, float("nan"), 2.0, float("nan"), 1.0]])
    got = kernels.top_candidates(scores, 4)[0].tolist()
    assert len(set(got)) == 4
    assert {0, 2, 4} <= set(got)


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
