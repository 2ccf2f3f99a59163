"""Gemma 3 (4B and up: SigLIP, pooled soft tokens, its projector) against transformers on a
tiny random Gemma3ForConditionalGeneration, fp32, loaded as a user loads it: from the Hugging
Face folder and from llama.cpp's GGUF + mmproj pair (a `gemma3` text GGUF, projector `gemma3`).
The vision tower's output, the merged sequence's logits (the soft tokens attending to each other
both ways) and 24 greedy tokens through the engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from prompt_logits import ImageRows, placeholders, prompt_logits
from tiny_gemma3_vl import (
    make_tiny_gemma3_vl,
    reference_gemma3,
    reference_pixels,
    write_gemma3_vl_gguf,
)

from modelhost.engine.engine import Engine, EngineConfig
from modelhost.engine.sampling.sampling_params import SamplingParams
from modelhost.engine.sequence import ImageSpan
from modelhost.models.loaded import LoadedModel
from modelhost.models.loading.loader import load_model

PROMPT = "<start_of_turn>user\nLook: <start_of_image> What is in the picture?<end_of_turn>\n"
PROMPT += "<start_of_turn>model\n"
# The GGUF pair's projection is F16, as llama.cpp's converter stores it (2.7e-3 here).
LOGIT_TOLERANCE = {"hf": 1e-3, "gguf": 1e-2}


def random_image(height: int, width: int) -> Image.Image:
    rng = np.random.default_rng(height * 1000 + width)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


@pytest.fixture(scope="module")
def folder(tmp_path_factory, smollm2):
    return make_tiny_gemma3_vl(tmp_path_factory.mktemp("gemma3-vl"), smollm2)


@pytest.fixture(scope="module")
def reference(folder):
    return reference_gemma3(folder)


@pytest.fixture(scope="module", params=["hf", "gguf"])
def source(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def ours(source, folder) -> LoadedModel:
    if source == "hf":
        return load_model(str(folder), quantize="none")
    model_path = write_gemma3_vl_gguf(folder, folder.parent / f"{folder.name}-gguf")
    return load_model(str(model_path), quantize="none")


def our_prompt(model: LoadedModel, image: Image.Image) -> tuple[list[int], ImageSpan]:
    """The prompt's ids with the image's plan in place of its marker, and the image's span."""
    assert model.vision is not None
    plan = model.vision.plan(image)
    before, after = PROMPT.split(model.vision.marker)
    ids = model.tokenizer.encode(before + plan.text + after, add_special_tokens=False)
    at = tuple(i for i, t in enumerate(ids) if t == model.vision.image_token_id)
    assert len(at) == plan.n_tokens
    return ids, ImageSpan(at[0], len(at), b"picture", plan, at)


def reference_inputs(ids: list[int], soft_token: int, image: Image.Image) -> dict:
    input_ids = torch.tensor([ids])
    return dict(
        input_ids=input_ids,
        pixel_values=reference_pixels(image),
        token_type_ids=(input_ids == soft_token).long(),
    )


def merged_logits(model: LoadedModel, ids: list[int], rows: torch.Tensor) -> torch.Tensor:
    """Logits at every position of one prefill, the soft tokens' rows in place and attending
    to each other both ways."""
    assert model.vision is not None
    at = placeholders(ids, model.vision.image_token_id)
    return prompt_logits(model, ids, ImageRows(at, rows, both_ways=True))


@pytest.mark.parametrize("size", [(120, 200), (300, 90)])
def test_gemma3_tower_output_matches_transformers(ours, reference, size):
    assert ours.vision is not None
    image = random_image(*size)
    with torch.no_grad():
        expected = reference.model.get_image_features(reference_pixels(image)).pooler_output[0]
    got = ours.vision.encode(ours.vision.plan(image))
    assert got.shape == expected.shape == (4, 64)
    # The GGUF pair's projection is F16, as llama.cpp's converter stores it.
    assert torch.allclose(got, expected, atol=2e-3, rtol=0)


def test_gemma3_merged_sequence_logits_match_transformers(ours, source, reference):
    assert ours.vision is not None
    image = random_image(120, 200)
    ids, span = our_prompt(ours, image)
    with torch.no_grad():
        inputs = reference_inputs(ids, ours.vision.image_token_id, image)
        expected = reference(**inputs).logits[0]
    got = merged_logits(ours, ids, ours.vision.encode(span.plan))
    assert torch.allclose(got, expected, atol=LOGIT_TOLERANCE[source], rtol=0)


async def test_gemma3_greedy_tokens_about_an_image_match_transformers(ours, reference):
    assert ours.vision is not None
    image = random_image(300, 90)
    ids, span = our_prompt(ours, image)
    with torch.no_grad():
        out = reference.generate(
            **reference_inputs(ids, ours.vision.image_token_id, image),
            max_new_tokens=24,
            min_new_tokens=24,
            do_sample=False,
        )
    expected = out[0, len(ids) :].tolist()
    engine = Engine(ours, EngineConfig(batch=1, kv_cache_bytes=4 << 20))
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    try:
        events = [event async for event in engine.submit(ids, greedy, (span,))]
    finally:
        engine.close()
    assert [token for event in events for token in event.token_ids] == expected
