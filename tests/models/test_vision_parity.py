"""SmolVLM (Idefics3) against transformers on a tiny random checkpoint, fp32: the image
processor's pixels and prompt, the vision tower's output, the merged sequence's logits (our
network with `embed_override` against transformers' forward with pixel values) and 24 greedy
tokens. From the Hugging Face folder and from llama.cpp's GGUF + mmproj pair."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from PIL import Image
from prompt_logits import ImageRows, placeholders, prompt_logits
from tiny_vision import (
    make_tiny_smolvlm,
    reference_processor,
    reference_smolvlm,
    write_smolvlm_gguf,
)

from modelhost.models.loaded import LoadedModel
from modelhost.models.loading.loader import load_model

# (height, width): wide, tall, small square (upscaled, 4 x 4 tiles), a strip, one tile exactly
SIZES = [(120, 200), (200, 120), (40, 40), (30, 500), (64, 64)]
LOGIT_TOLERANCE = 1e-3


def random_image(height: int, width: int, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(height * 1000 + width)
    channels = len(mode)
    pixels = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(pixels, mode)


@pytest.fixture(scope="module")
def folder(tmp_path_factory, smollm2):
    return make_tiny_smolvlm(tmp_path_factory.mktemp("smolvlm"), smollm2)


@pytest.fixture(scope="module")
def reference(folder):
    return reference_smolvlm(folder), reference_processor(folder)


@pytest.fixture(scope="module", params=["hf", "gguf"])
def ours(request, folder) -> LoadedModel:
    if request.param == "hf":
        return load_model(str(folder), quantize="none")
    model_path = write_smolvlm_gguf(folder, folder.parent / f"{folder.name}-gguf")
    return load_model(str(model_path), quantize="none")


def reference_inputs(processor, prompt: str, image: Image.Image):
    return processor(text=[prompt], images=[[image]], return_tensors="pt")


def our_ids(model: LoadedModel, prompt: str, image: Image.Image) -> tuple[list[int], torch.Tensor]:
    """The prompt's ids with the image's plan in place of the marker, and the tower's rows."""
    assert model.vision is not None
    plan = model.vision.plan(image)
    before, after = prompt.split(model.vision.marker)
    ids = model.tokenizer.encode(before + plan.text + after)
    return ids, model.vision.encode(plan)


def logits_with_image(model: LoadedModel, ids: list[int], rows: torch.Tensor) -> torch.Tensor:
    """Next-token logits at every position, one prefill through the paged KV cache, the
    image rows overwriting the placeholders' embeddings."""
    assert model.vision is not None
    at = placeholders(ids, model.vision.image_token_id)
    return prompt_logits(model, ids, ImageRows(at, rows))


@pytest.mark.parametrize("size", SIZES)
def test_image_plan_gives_transformers_pixels_and_prompt(folder, reference, size):
    model = load_model(str(folder), quantize="none")
    _, processor = reference
    image = random_image(*size)
    prompt = "User:<image>What is in the picture?<end_of_utterance>\nAssistant:"
    expected = reference_inputs(processor, prompt, image)
    assert model.vision is not None
    plan = model.vision.plan(image)
    tiles = expected["pixel_values"][0]
    assert torch.equal(plan.pixels.tiles, tiles)
    ids, _ = our_ids(model, prompt, image)
    assert ids == expected["input_ids"][0].tolist()
    assert sum(t == model.vision.image_token_id for t in ids) == plan.n_tokens


def test_image_without_splitting_is_one_global_tile(folder, reference):
    model = load_model(str(folder), quantize="none")
    assert model.vision is not None
    tower = model.vision
    tower.image_config = dataclasses.replace(tower.image_config, do_splitting=False)
    _, processor = reference
    image = random_image(120, 200)
    expected = processor(
        text=["<image>"], images=[[image]], return_tensors="pt", do_image_splitting=False
    )
    plan = tower.plan(image)
    assert torch.equal(plan.pixels.tiles, expected["pixel_values"][0])
    assert model.tokenizer.encode(plan.text) == expected["input_ids"][0].tolist()


def test_transparent_image_is_laid_over_white_as_transformers_does(folder, reference):
    model = load_model(str(folder), quantize="none")
    _, processor = reference
    image = random_image(90, 150, "RGBA")
    expected = reference_inputs(processor, "<image>", image)
    assert model.vision is not None
    assert torch.equal(model.vision.plan(image).pixels.tiles, expected["pixel_values"][0])


@pytest.mark.parametrize("size", [(120, 200), (64, 64)])
def test_vision_tower_output_matches_transformers(ours, reference, size):
    network, processor = reference
    image = random_image(*size)
    inputs = reference_inputs(processor, "<image>", image)
    with torch.no_grad():
        features = network.model.get_image_features(
            inputs["pixel_values"], inputs["pixel_attention_mask"]
        ).pooler_output
    expected = torch.cat(list(features)) if isinstance(features, list | tuple) else features
    _, rows = our_ids(ours, "<image>", image)
    assert rows.shape == expected.shape
    assert torch.allclose(rows, expected, atol=1e-4, rtol=0)


PROMPT = "User:Look: <image> What is in the picture?<end_of_utterance>\nAssistant:"


def test_merged_sequence_logits_match_transformers(ours, reference):
    network, processor = reference
    image = random_image(120, 200)
    inputs = reference_inputs(processor, PROMPT, image)
    with torch.no_grad():
        expected = network(**inputs).logits[0]
    ids, rows = our_ids(ours, PROMPT, image)
    got = logits_with_image(ours, ids, rows)
    assert torch.allclose(got, expected, atol=LOGIT_TOLERANCE, rtol=0)


def test_greedy_continuation_about_an_image_matches_transformers(ours, reference):
    network, processor = reference
    image = random_image(200, 120)
    inputs = reference_inputs(processor, PROMPT, image)
    with torch.no_grad():
        out = network.generate(**inputs, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    expected = out[0, inputs["input_ids"].shape[1] :].tolist()
    ids, rows = our_ids(ours, PROMPT, image)
    got: list[int] = []
    for _ in range(24):  # the whole sequence again each step: the image rows stay in place
        got.append(int(logits_with_image(ours, ids + got, rows)[-1].argmax()))
    assert got == expected


def test_a_text_only_model_has_no_tower_and_says_so(smollm2):
    assert smollm2.vision is None
    assert smollm2.family.vision is False


def test_smolvlm_folder_reads_images(ours):
    assert ours.vision is not None and ours.family.vision is True
    assert ours.vision.marker == "<image>"
