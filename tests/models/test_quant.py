"""How CPU linears hold their weights (loading/quant.py): the file's own form, or a mode's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.quants import dequantize
from gguf_blocks import T
from prompt_logits import prompt_logits

from modelhost.models.kernels import native
from modelhost.models.loaded import LoadedModel
from modelhost.models.loading import footprint
from modelhost.models.loading.embedded import embedded_path
from modelhost.models.loading.footprint import target_type
from modelhost.models.loading.loader import load_model
from modelhost.models.loading.quant import Bf16Linear, DenseLinear, describe, quantize_blocks

needs_kernels = pytest.mark.skipif(native.kernels() is None, reason="no native kernels here")


def test_dense_linear_is_the_fp32_linear():
    weight, bias = torch.randn(48, 64), torch.randn(48)
    x = torch.randn(3, 64)
    expected = torch.nn.functional.linear(x, weight, bias)
    assert torch.allclose(DenseLinear(weight, bias)(x), expected, atol=1e-5)


def test_bf16_linear_is_the_fp32_linear_within_bf16_rounding():
    torch.manual_seed(0)
    weight, bias, x = torch.randn(96, 64) * 0.1, torch.randn(96) * 0.1, torch.randn(3, 5, 64)
    got = Bf16Linear(weight, bias)(x)
    expected = torch.nn.functional.linear(x, weight, bias)
    assert got.shape == (3, 5, 96)
    # bf16 keeps 8 significant bits: inputs, weights and outputs each rounded once
    assert (got.float() - expected).norm() / expected.norm() < 1e-2


@pytest.mark.parametrize(("qtype", "tolerance"), [(T.Q8_0, 0.005), (T.Q4_1, 0.07)])
def test_float_weights_quantize_to_gguf_blocks_that_gguf_reads_back(qtype, tolerance):
    weight = torch.randn(40, 96)
    blocks = quantize_blocks(weight, int(qtype))
    restored = torch.from_numpy(np.array(dequantize(blocks.numpy(), qtype))).reshape(40, 96)
    assert (restored - weight).abs().max() / weight.abs().max() < tolerance


def test_auto_keeps_every_type_and_int8_turns_only_float_weights_into_q8_0():
    for qtype in (T.F16, T.BF16, T.Q4_K, T.Q6_K, T.Q8_0, T.Q2_K):
        assert target_type(int(qtype), "auto") == int(qtype)
    assert target_type(footprint.BF16, "int8") == footprint.Q8_0
    assert target_type(footprint.Q6_K, "int8") == footprint.Q6_K


def test_int4_squeezes_wider_weights_into_q4_1_and_keeps_narrower_ones():
    assert (
        target_type(footprint.Q6_K, "int4") == target_type(footprint.F16, "int4") == footprint.Q4_1
    )
    for qtype in (footprint.Q4_K, footprint.Q4_0, footprint.Q3_K, footprint.Q2_K):
        assert target_type(qtype, "int4") == qtype


@pytest.fixture(scope="module")
def smollm2_modes() -> dict[str, LoadedModel]:
    name = "smollm2-135m-instruct"
    return {
        "raw": load_model(name, prepare=False),
        "none": load_model(name, quantize="none"),
        "auto": load_model(name, quantize="auto"),
    }


def test_quantized_models_cache_keys_and_values_in_fp16_and_none_keeps_fp32(smollm2_modes):
    half = native.kernels() is not None  # only the native attention reads an fp16 pool
    assert smollm2_modes["auto"].cache_dtype == (torch.float16 if half else torch.float32)
    assert smollm2_modes["none"].cache_dtype == torch.float32


@needs_kernels
def test_auto_keeps_each_tensor_of_the_gguf_in_its_own_type(smollm2_modes):
    # SmolLM2's GGUF: 7 linears a layer in Q4_1 (q/k/v and gate/up fused), a Q8_0 embedding
    # that is also the head.
    assert describe(smollm2_modes["auto"].network) == {"Q4_1": 30 * 4, "Q8_0": 1}


@needs_kernels
@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "gemma-3-270m"])
def test_a_gguf_model_holds_about_the_bytes_of_its_file(name, request):
    path = embedded_path(name)
    assert path is not None
    model = load_model(name)
    assert 0.9 * path.stat().st_size < model.weights_bytes < 1.05 * path.stat().st_size


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
        logits = prompt_logits(model, prompt)[:-1]
        return torch.nn.functional.cross_entropy(logits, target).exp().item()

    reference = perplexity(raw)
    # Rounded activations: well under 1% on the 700-token text of benchmarks/perplexity.py.
    assert abs(perplexity(smollm2_modes["auto"]) / reference - 1) < 0.05
