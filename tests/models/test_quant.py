"""CPU linears prepared at load (models/quant.py): fused projections and weight-only int8/int4."""

from __future__ import annotations

import pytest
import torch
from prompt_logits import prompt_logits

from modelhost.models import native
from modelhost.models.loaded import LoadedModel
from modelhost.models.loader import load_model
from modelhost.models.quant import (
    DenseLinear,
    Int4Linear,
    Int4RankingHead,
    Int8Linear,
    RefinedHead,
    exact_int4,
    quantize_int4,
    token_roles,
)


def four_bit_weight(rows: int, cols: int, low: int = 0, high: int = 15) -> torch.Tensor:
    """A weight whose groups of 32 hold levels low..high of a per-group step and offset."""
    torch.manual_seed(0)
    q = torch.randint(low, high + 1, (rows, cols // 32, 32)).float()
    step = torch.rand(rows, cols // 32, 1) * 0.01 + 0.001
    offset = torch.randn(rows, cols // 32, 1) * 0.05
    return (q * step + offset).reshape(rows, cols)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected).abs().max() / expected.abs().max()).item()


def test_int4_finds_the_grid_of_weights_that_are_already_four_bit():
    weight = four_bit_weight(64, 128, low=2, high=13)  # not spanning 0..15: step is not span/15
    q, steps, low = quantize_int4(weight)
    restored = (q.float() * steps[..., None] + low[..., None]).reshape(weight.shape)
    assert exact_int4(weight)
    assert torch.allclose(restored, weight, atol=1e-6)


def test_random_weights_are_not_exact_int4():
    assert not exact_int4(torch.randn(32, 64))


def test_int4_linear_matches_fp32_within_activation_rounding():
    weight = four_bit_weight(96, 128)
    x = torch.randn(5, 128)
    expected = x @ weight.t()
    assert relative_error(Int4Linear(weight, None)(x), expected) < 1e-2


def test_prompt_tokens_take_the_fp32_weight_and_generated_tokens_the_int4_kernel():
    weight = four_bit_weight(96, 128)
    linear = Int4Linear(weight, None)
    assert linear.prompt_weight_t is not None  # the int4 weight, dequantized
    assert relative_error(linear.prompt_weight_t.t(), weight) < 1e-2
    x = torch.randn(5, 128)
    fp32, kernel = x @ linear.prompt_weight_t, linear(x).float()  # outside a step: the kernel
    assert not torch.equal(kernel, fp32)  # rounded activations: not the fp32 product
    with token_roles(torch.arange(5), None):
        assert torch.equal(linear(x), fp32)
    prompt, generated = torch.tensor([0, 3]), torch.tensor([1, 2, 4])
    with token_roles(prompt, generated):
        mixed = linear(x)
    # The prompt rows' own fp32 product: sgemm need not give a row the same bits in a
    # product of 2 rows as of 5 (MKL's AVX2 kernels do not).
    assert torch.equal(mixed[prompt], x[prompt] @ linear.prompt_weight_t)
    assert torch.allclose(mixed[prompt], fp32[prompt], rtol=1e-5, atol=1e-5)
    assert torch.equal(mixed[generated], linear(x[generated]).float())


def test_int8_linear_matches_fp32_within_tolerance():
    weight = torch.randn(96, 128)
    x = torch.randn(5, 128)
    expected = x @ weight.t()
    assert relative_error(Int8Linear(weight, None)(x), expected) < 2e-2


def test_dense_linear_is_the_fp32_linear():
    weight, bias = torch.randn(48, 64), torch.randn(48)
    x = torch.randn(3, 64)
    expected = torch.nn.functional.linear(x, weight, bias)
    assert torch.allclose(DenseLinear(weight, bias)(x), expected, atol=1e-5)


def test_refined_head_gives_exact_logits_for_the_best_tokens():
    torch.manual_seed(1)
    weight = torch.randn(512, 64)
    x = torch.randn(4, 64)
    expected = x @ weight.t()
    head = RefinedHead(Int4Linear(weight, None), weight, top=8)
    got = head(x)
    best = expected.topk(3, dim=-1).indices
    assert torch.allclose(got.gather(1, best), expected.gather(1, best), atol=1e-4)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_the_head_ranks_with_int4_weights_and_int8_dot_products_where_the_cpu_has_them(
    smollm2_modes,
):
    head = smollm2_modes["auto"].network.lm_head
    kernels = native.kernels()
    expected = Int4RankingHead if kernels is not None else Int4Linear
    assert isinstance(head, RefinedHead)
    assert isinstance(head.approx, expected)


def test_quantized_models_cache_keys_and_values_in_fp16_and_none_keeps_fp32(smollm2_modes):
    half = native.kernels() is not None  # only the native attention reads an fp16 pool
    assert smollm2_modes["auto"].cache_dtype == (torch.float16 if half else torch.float32)
    assert smollm2_modes["none"].cache_dtype == torch.float32


@pytest.fixture(scope="module")
def smollm2_modes() -> dict[str, LoadedModel]:
    name = "smollm2-135m-instruct"
    return {
        "raw": load_model(name, prepare=False),
        "none": load_model(name, quantize="none"),
        "auto": load_model(name, quantize="auto"),
    }


def test_fused_fp32_projections_give_the_same_logits(smollm2_modes):
    raw = smollm2_modes["raw"]
    prompt = raw.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)
    expected = prompt_logits(raw, prompt)
    got = prompt_logits(smollm2_modes["none"], prompt)
    assert torch.allclose(got, expected, atol=1e-4, rtol=0)


def test_auto_mode_keeps_perplexity_within_five_percent(smollm2_modes):
    raw = smollm2_modes["raw"]
    text = "Four score and seven years ago our fathers brought forth on this continent, a new "
    text += "nation, conceived in Liberty, and dedicated to the proposition that all men are "
    text += "created equal. Now we are engaged in a great civil war, testing whether that nation"
    prompt = raw.tokenizer.encode(text)
    target = torch.tensor(prompt[1:])

    def perplexity(model: LoadedModel) -> float:
        logits = prompt_logits(model, prompt, as_generated=True)[:-1]
        return torch.nn.functional.cross_entropy(logits, target).exp().item()

    reference = perplexity(raw)
    # Rounded activations: well under 1% on the 700-token text of benchmarks/perplexity.py.
    assert abs(perplexity(smollm2_modes["auto"]) / reference - 1) < 0.05
    assert "Int4Linear" in {type(m).__name__ for m in smollm2_modes["auto"].network.modules()}
