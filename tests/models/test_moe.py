"""Qwen3-MoE's own parts (models/networks/moe.py, native_moe.h) on a tiny random checkpoint; its
parity with transformers (folder and GGUF, fp32, native, Q8_0) is tests/models/test_parity.py's,
through tiny_models.ARCHITECTURES["qwen3_moe"]."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from models.test_fused_decode import greedy_with_logprobs
from models.test_parity import LOGIT_TOLERANCE, PROMPTS
from prompt_logits import prompt_logits
from tiny_gguf import write_gguf_from_hf
from tiny_models import make_tiny_checkpoint, reference_model

from modelhost.models.kernels import native
from modelhost.models.loading.loader import load_model
from modelhost.models.networks.moe import SparseMoE
from modelhost.residency.registry import ModelRegistry

needs_kernels = pytest.mark.skipif(native.kernels() is None, reason="no native kernels here")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, smollm2) -> Path:
    # test_parity's spread (0.3): a decisive router, logits that routing mistakes move far
    directory = tmp_path_factory.mktemp("qwen3_moe")
    return make_tiny_checkpoint(
        directory, "qwen3_moe", smollm2, max_position_embeddings=1024, initializer_range=0.3
    )


@pytest.fixture(scope="module")
def q8_0_file(checkpoint, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("q8_0") / "tiny-qwen3moe-q8_0.gguf"
    return write_gguf_from_hf(checkpoint, path, "Q8_0")


def test_the_sparse_layers_are_mixtures_of_experts_and_the_dense_one_is_not(checkpoint, q8_0_file):
    for source in (checkpoint, q8_0_file):  # mlp_only_layers=[1]; a GGUF's layer without router
        model = load_model(str(source), quantize="none")
        kinds = [isinstance(layer.mlp, SparseMoE) for layer in model.network.model.blocks()]
        assert kinds == [True, False, True]


def test_routing_mistakes_would_show_beyond_the_parity_tolerance(checkpoint, smollm2):
    """The parity tests can fail: skipping the renormalisation, or taking one expert of two,
    moves the logits far past their tolerance."""
    model = load_model(str(checkpoint), quantize="none")
    prompt = smollm2.tokenizer.encode(PROMPTS["medium"])
    with torch.no_grad():
        expected = reference_model(checkpoint)(torch.tensor([prompt])).logits[0]
    assert torch.allclose(prompt_logits(model, prompt), expected, atol=LOGIT_TOLERANCE, rtol=0)
    layers = [
        layer.mlp for layer in model.network.model.blocks() if isinstance(layer.mlp, SparseMoE)
    ]
    for change in ({"norm_topk_prob": False}, {"top_k": 1}):
        saved = [(moe.norm_topk_prob, moe.top_k) for moe in layers]
        for moe in layers:
            for name, value in change.items():
                setattr(moe, name, value)
        error = (prompt_logits(model, prompt) - expected).abs().max()
        for moe, (norm, top_k) in zip(layers, saved, strict=True):
            moe.norm_topk_prob, moe.top_k = norm, top_k
        assert error > 100 * LOGIT_TOLERANCE, change


@needs_kernels
def test_fused_decode_steps_route_and_compute_as_the_module_path(q8_0_file):
    model = load_model(str(q8_0_file))
    moe = model.network.model.layers[0].mlp
    assert isinstance(moe, SparseMoE) and moe.native_experts() is not None
    assert model.network.fused_decode() is not None  # the MoE layers run in it too
    fused = greedy_with_logprobs(model, fused=True)
    assert all(len(tokens) == 24 for tokens in fused)
    assert fused == greedy_with_logprobs(model, fused=False)


@needs_kernels
def test_the_registry_sizes_a_moe_file_as_loading_holds_it(q8_0_file, tmp_path):
    registry = ModelRegistry([q8_0_file.parent], home=tmp_path / "home", hf_hub=tmp_path / "hub")
    [entry] = [e for e in registry.entries() if e.path == q8_0_file]
    assert entry.architecture == "qwen3moe" and entry.refusal is None
    held = load_model(str(q8_0_file)).weights_bytes
    # experts packed one by one, as the file holds them (the router differs: dense fp32)
    assert abs(entry.weights_bytes - held) < 0.01 * held
