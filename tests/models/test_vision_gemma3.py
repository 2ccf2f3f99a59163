"""Gemma 3's vision tower against transformers on a tiny random Gemma3ForConditionalGeneration:
the image processor's pixels, the prompt text that stands for an image, and the soft tokens
(SigLIP, average pooling, RMSNorm, projection). The decoder side waits on a bidirectional image
block in the attention (models/vision/gemma3.py), so a Gemma 3 folder still loads text-only."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from modelhost.models.loading.hf_config import config_from_hf
from modelhost.models.loading.load_safetensors import safetensors_tensors
from modelhost.models.loading.weights import WeightPlan
from modelhost.models.vision.load import gemma3_hf_tower

IMAGE = 64
PROCESSOR = dict(size={"height": IMAGE, "width": IMAGE}, image_mean=[0.5, 0.4, 0.3])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gemma3-vision")
    config = transformers.Gemma3Config(
        text_config=dict(
            vocab_size=300,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
        ),
        vision_config=dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=IMAGE,
            patch_size=16,
            initializer_range=0.2,
        ),
        mm_tokens_per_image=4,
        image_token_index=299,
        boi_token_index=297,
        eoi_token_index=298,
    )
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "mm_input_projection" in name:
                param.uniform_(-0.5, 0.5)
    model.save_pretrained(directory)
    transformers.Gemma3ImageProcessorPil(**PROCESSOR).save_pretrained(directory)
    return directory, model


def image(height: int, width: int, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(height + width)
    return Image.fromarray(rng.integers(0, 256, (height, width, len(mode)), dtype=np.uint8), mode)


@pytest.fixture(scope="module")
def tower(checkpoint):
    directory, _ = checkpoint
    raw = json.loads((directory / "config.json").read_text())
    sources = safetensors_tensors(directory, config_from_hf(raw))
    plan = WeightPlan("none", torch.device("cpu"), torch.float32)
    return gemma3_hf_tower(directory, raw, sources, plan, lambda token: None)


@pytest.mark.parametrize("size", [(120, 200), (300, 90), (64, 64)])
def test_gemma3_pixels_match_transformers(tower, size):
    processor = transformers.Gemma3ImageProcessorPil(**PROCESSOR)
    picture = image(*size, "RGBA" if size == (64, 64) else "RGB")
    expected = processor(images=[picture], return_tensors="pt")["pixel_values"]
    assert torch.equal(tower.plan(picture).pixels, expected)


def test_gemma3_plan_text_holds_one_placeholder_per_soft_token(tower):
    plan = tower.plan(image(100, 100))
    assert tower.marker == "<start_of_image>" and tower.image_token_id == 299
    assert plan.n_tokens == 4
    assert plan.text == "\n\n<start_of_image>" + "<image_soft_token>" * 4 + "<end_of_image>\n\n"


def test_gemma3_soft_tokens_match_transformers(tower, checkpoint):
    _, model = checkpoint
    processor = transformers.Gemma3ImageProcessorPil(**PROCESSOR)
    picture = image(120, 200)
    pixels = processor(images=[picture], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        expected = model.model.get_image_features(pixels).pooler_output[0]
    got = tower.encode(tower.plan(picture))
    assert got.shape == expected.shape == (4, 64)
    assert torch.allclose(got, expected, atol=1e-4, rtol=0)
