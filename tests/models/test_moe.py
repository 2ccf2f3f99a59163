"""Qwen3-MoE (models/moe.py) against transformers, fp32, on a tiny random checkpoint: loaded
from its Hugging Face folder and from the same weights written as a `qwen3moe` GGUF; and the
quantized path (Q8_0 experts on the native kernels) agreeing with it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from models.test_fused_decode import greedy_with_logprobs
from models.test_parity import LOGIT_TOLERANCE, our_greedy, reference_greedy
from moe_gguf import write_moe_gguf
from prompt_logits import prompt_logits
from tiny_models import make_tiny_checkpoint, reference_model

from modelhost.models import native
from modelhost.models.loaded import LoadedModel
from modelhost.models.loader import load_model
from modelhost.models.moe import SparseMoE
from modelhost.residency.registry import ModelRegistry

TEXT = "The quick brown fox jumps over the lazy dog, and then it rests. "


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, smollm2):
    directory = make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe", smollm2)
    # At initialisation's spread the logits stay within +-0.2 and the router is nearly
    # uniform: skipping the renormalisation, or taking one expert instead of two, moves them
    # by ~1e-3 only. Scaled up (logits ~ +-6, a decisive router) either moves them by ~0.8.
    model = reference_model(directory)
    with torch.no_grad():
        for name, param in model.named_parameters():
            scale = 25 if "embed" in name else 20 if "mlp.gate." in name else 8
            param.mul_(scale if "embed" in name or "mlp" in name else 1)
    model.save_pretrained(directory)
    return directory, reference_model(directory)


@pytest.fixture(scope="module")
def prompts(smollm2) -> dict[int, list[int]]:
    ids = smollm2.tokenizer.encode(TEXT * 60)
    return {length: ids[:length] for length in (8, 90, 700)}


@pytest.fixture(scope="module")
def references(checkpoint, prompts) -> dict[int, torch.Tensor]:
    _, reference = checkpoint
    with torch.no_grad():
        return {n: reference(torch.tensor([ids])).logits[0] for n, ids in prompts.items()}


@pytest.fixture(scope="module", params=["folder", "gguf"])
def ours(request, checkpoint, tmp_path_factory) -> LoadedModel:
    directory, _ = checkpoint
    if request.param == "folder":
        return load_model(str(directory), quantize="none")
    path = tmp_path_factory.mktemp("gguf") / "tiny-qwen3moe-f32.gguf"
    write_moe_gguf(directory, path, GGMLQuantizationType.F32)
    return load_model(str(path), quantize="none")


def test_the_sparse_layers_are_mixtures_of_experts_and_the_dense_one_is_not(ours):
    kinds = [isinstance(layer.mlp, SparseMoE) for layer in ours.network.model.blocks()]
    assert kinds == [True, False, True]  # mlp_only_layers=[1]


@pytest.mark.parametrize("length", [8, 90, 700])
def test_prompt_logits_match_transformers(ours, prompts, references, length):
    got = prompt_logits(ours, prompts[length])
    assert torch.allclose(got, references[length], atol=LOGIT_TOLERANCE, rtol=0)


def test_greedy_continuation_matches_transformers(ours, checkpoint, prompts):
    _, reference = checkpoint
    prompt = prompts[90]
    assert our_greedy(ours, prompt, 24) == reference_greedy(reference, prompt, 24)


needs_kernels = pytest.mark.skipif(native.kernels() is None, reason="no native kernels here")


@needs_kernels
def test_packed_fp32_experts_on_the_native_kernels_match_transformers(
    checkpoint, prompts, references
):
    directory, _ = checkpoint
    model = load_model(str(directory), quantize="auto")  # F32 tiles, mh_moe_experts
    moe = model.network.model.layers[0].mlp
    assert isinstance(moe, SparseMoE) and moe.native_experts() is not None
    got = prompt_logits(model, prompts[700])
    assert torch.allclose(got, references[700], atol=LOGIT_TOLERANCE, rtol=0)


@pytest.fixture(scope="module")
def q8_0_file(checkpoint, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("q8_0") / "tiny-qwen3moe-q8_0.gguf"
    return write_moe_gguf(checkpoint[0], path, GGMLQuantizationType.Q8_0)


@needs_kernels
def test_q8_0_experts_agree_with_transformers(checkpoint, prompts, references, q8_0_file):
    _, reference = checkpoint
    model = load_model(str(q8_0_file), quantize="auto")
    got = prompt_logits(model, prompts[700])
    expected = references[700]
    error = (got - expected).abs()
    agreement = (got.argmax(-1) == expected.argmax(-1)).float().mean()
    # logits ~ +-6; a token whose router's choice flips under rounding moves further
    assert error.mean() < 0.03
    assert agreement >= 0.95
    prompt = prompts[90]
    pairs = zip(our_greedy(model, prompt, 24), reference_greedy(reference, prompt, 24), strict=True)
    assert sum(a == b for a, b in pairs) >= 20


@needs_kernels
def test_the_registry_sizes_a_moe_file_as_loading_holds_it(q8_0_file, tmp_path):
    registry = ModelRegistry([q8_0_file.parent], home=tmp_path / "home", hf_hub=tmp_path / "hub")
    [entry] = [e for e in registry.entries() if e.path == q8_0_file]
    assert entry.architecture == "qwen3moe" and entry.refusal is None
    held = load_model(str(q8_0_file)).weights_bytes
    # experts packed one by one, as the file holds them (the router differs: dense fp32)
    assert abs(entry.weights_bytes - held) < 0.01 * held


@needs_kernels
def test_fused_decode_steps_route_and_compute_as_the_module_path(q8_0_file):
    model = load_model(str(q8_0_file))
    assert model.network.fused_decode() is not None  # the MoE layers run natively too
    fused = greedy_with_logprobs(model, fused=True)
    assert all(len(tokens) == 24 for tokens in fused)
    assert fused == greedy_with_logprobs(model, fused=False)
