"""Gemma 3's vision tower against transformers on a tiny random Gemma3ForConditionalGeneration:
the image processor's pixels, the prompt text that stands for an image, and the soft tokens
(SigLIP, average pooling, RMSNorm, projection); and the decoder's logits and greedy tokens with
the soft tokens in place, attending to each other both ways as the engine is to arrange
(ForwardBatch.bidirectional), by hand and through the engine, whose chunks never split an
image."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from prompt_logits import ImageRows, placeholders, prompt_logits
from tiny_gemma3_vl import write_gemma3_mmproj

from modelhost.engine.engine import Engine, EngineConfig
from modelhost.engine.sampling.sampling_params import SamplingParams
from modelhost.engine.sequence import ImageSpan
from modelhost.models.loading.hf_config import config_from_hf
from modelhost.models.loading.load_safetensors import safetensors_tensors
from modelhost.models.loading.loader import build_network
from modelhost.models.loading.weights import WeightPlan, fill_network
from modelhost.models.vision.load import gemma3_hf_tower, gemma3_mmproj_tower
from modelhost.residency.model_facts import model_facts
from modelhost.residency.registry import ModelRegistry

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


@pytest.fixture(scope="module")
def text_model(checkpoint, gemma3):
    """The checkpoint's decoder as our network (fp32), carried by a LoadedModel whose
    tokenizer is the embedded Gemma 3's (the test feeds ids directly)."""
    directory, _ = checkpoint
    raw = json.loads((directory / "config.json").read_text())
    config = config_from_hf(raw)
    with torch.device("meta"):
        network = build_network(config)
    plan = WeightPlan("none", torch.device("cpu"), torch.float32)
    fill_network(network, safetensors_tensors(directory, config), plan)
    return dataclasses.replace(
        gemma3, config=config, network=network, dtype=torch.float32, kv_dtype=None, vision=None
    )


BOI, SOFT, EOI = 297, 299, 298
TEXT_IDS = [2, 17, 45, 101, 7, 64, 200, 33]


def merged_logits(model, tower, ids: list[int], rows: torch.Tensor) -> torch.Tensor:
    """One prefill of `ids`, the soft tokens' rows in place and attending to each other both
    ways when the tower is bidirectional."""
    at = placeholders(ids, tower.image_token_id)
    return prompt_logits(model, ids, ImageRows(at, rows, both_ways=tower.bidirectional))


def test_gemma3_merged_sequence_logits_match_transformers(tower, checkpoint, text_model):
    _, model = checkpoint
    picture = image(120, 200)
    pixels = transformers.Gemma3ImageProcessorPil(**PROCESSOR)(
        images=[picture], return_tensors="pt"
    )["pixel_values"]
    ids = TEXT_IDS[:5] + [BOI] + [SOFT] * 4 + [EOI] + TEXT_IDS[5:]
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        expected = model(
            input_ids=input_ids, pixel_values=pixels, token_type_ids=(input_ids == SOFT).long()
        ).logits[0]
    got = merged_logits(text_model, tower, ids, tower.encode(tower.plan(picture)))
    assert torch.allclose(got, expected, atol=1e-3, rtol=0)


def test_gemma3_greedy_continuation_about_an_image_matches_transformers(
    tower, checkpoint, text_model
):
    _, model = checkpoint
    picture = image(300, 90)
    pixels = transformers.Gemma3ImageProcessorPil(**PROCESSOR)(
        images=[picture], return_tensors="pt"
    )["pixel_values"]
    ids = TEXT_IDS[:3] + [BOI] + [SOFT] * 4 + [EOI] + TEXT_IDS[3:]
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            pixel_values=pixels,
            token_type_ids=(input_ids == SOFT).long(),
            max_new_tokens=24,
            min_new_tokens=24,
            do_sample=False,
        )
    expected = out[0, len(ids) :].tolist()
    rows = tower.encode(tower.plan(picture))
    got: list[int] = []
    for _ in range(24):
        got.append(int(merged_logits(text_model, tower, ids + got, rows)[-1].argmax()))
    assert got == expected


@pytest.mark.parametrize("chunk", [512, 6, 2])
async def test_gemma3_through_the_engine_gives_transformers_greedy_tokens(
    tower, checkpoint, text_model, chunk
):
    """The engine keeps the image's soft tokens in one step however small its chunks (6 ends
    the first before the image, 2 runs on to the image's end) and lets them see each other."""
    _, model = checkpoint
    picture = image(300, 90)
    pixels = transformers.Gemma3ImageProcessorPil(**PROCESSOR)(
        images=[picture], return_tensors="pt"
    )["pixel_values"]
    ids = TEXT_IDS[:3] + [BOI] + [SOFT] * 4 + [EOI] + TEXT_IDS[3:]
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            pixel_values=pixels,
            token_type_ids=(input_ids == SOFT).long(),
            max_new_tokens=24,
            min_new_tokens=24,
            do_sample=False,
        )
    expected = out[0, len(ids) :].tolist()
    positions = tuple(i for i, t in enumerate(ids) if t == SOFT)
    span = ImageSpan(positions[0], len(positions), b"picture", tower.plan(picture), positions)
    vlm = dataclasses.replace(text_model, vision=tower)
    config = EngineConfig(batch=1, kv_cache_bytes=4 << 20, max_num_batched_tokens=chunk)
    engine = Engine(vlm, config)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    try:
        events = [event async for event in engine.submit(ids, greedy, (span,))]
    finally:
        engine.close()
    assert [token for event in events for token in event.token_ids] == expected


def test_gemma3_mmproj_tower_matches_transformers(checkpoint, tmp_path):
    directory, model = checkpoint
    mmproj = write_gemma3_mmproj(directory, tmp_path / "mmproj-tiny-gemma3.gguf")
    plan = WeightPlan("none", torch.device("cpu"), torch.float32)
    tower = gemma3_mmproj_tower(mmproj, plan, {"<image_soft_token>": SOFT}.get)
    picture = image(120, 200)
    pixels = transformers.Gemma3ImageProcessorPil(**PROCESSOR)(
        images=[picture], return_tensors="pt"
    )["pixel_values"]
    our_plan = tower.plan(picture)
    assert torch.equal(our_plan.pixels, pixels) and our_plan.n_tokens == 4
    with torch.no_grad():
        expected = model.model.get_image_features(pixels).pooler_output[0]
    # The projection in F16, as the converter stores it.
    assert torch.allclose(tower.encode(our_plan), expected, atol=2e-3, rtol=0)


def test_registry_lists_a_gemma3_folder_with_a_vision_config_as_reading_images(
    checkpoint, tmp_path
):
    directory, _ = checkpoint
    registry = ModelRegistry([directory.parent], home=tmp_path / "home", hf_hub=tmp_path / "hub")
    entry = registry.get(directory.name)
    assert entry is not None and entry.refusal is None
    assert model_facts(entry).vision
