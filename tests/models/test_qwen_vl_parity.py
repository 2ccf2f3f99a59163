"""Qwen2.5-VL against transformers on a tiny random checkpoint, fp32: the image processor's
patches, grid and prompt, the vision tower's output (windowed and full attention, 2-D rotary,
patch merger), the merged sequence's logits (our network with `embed_override` and M-RoPE
positions against transformers' forward with pixel values) and 24 greedy tokens."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from PIL import Image
from prompt_logits import ImageRows, prompt_logits
from tiny_qwen_vl import (
    make_tiny_qwen_vl,
    reference_inputs,
    reference_qwen_vl,
    write_qwen_vl_gguf,
)

from modelhost.engine.engine import Engine, EngineConfig
from modelhost.engine.sampling.sampling_params import SamplingParams
from modelhost.engine.scheduler import ScheduledRow, SchedulerOutput
from modelhost.engine.sequence import Sequence
from modelhost.models.loaded import LoadedModel
from modelhost.models.loading.loader import load_model
from modelhost.models.vision.mrope import step_mrope_positions
from modelhost.models.vision.tower import ImagePlan

# (height, width): wide (two windows across), small (scaled up to the pixel floor), a strip,
# large (scaled down to the pixel ceiling, several windows both ways)
SIZES = [(120, 200), (40, 40), (30, 500), (600, 400)]
LOGIT_TOLERANCE = 1e-3
PROMPT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    "Look: <|vision_start|><|image_pad|><|vision_end|> What is in the picture?<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def random_image(height: int, width: int, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(height * 1000 + width)
    pixels = rng.integers(0, 256, (height, width, len(mode)), dtype=np.uint8)
    return Image.fromarray(pixels, mode)


@dataclass(frozen=True)
class Placed:
    """An image in a row, as the engine's ImageSpan holds it."""

    start: int
    plan: ImagePlan


@pytest.fixture(scope="module")
def folder(tmp_path_factory, smollm2):
    return make_tiny_qwen_vl(tmp_path_factory.mktemp("qwen_vl"), smollm2)


@pytest.fixture(scope="module")
def reference(folder):
    return reference_qwen_vl(folder)


@pytest.fixture(scope="module")
def from_folder(folder) -> LoadedModel:
    return load_model(str(folder), quantize="none")


@pytest.fixture(scope="module", params=["hf", "gguf"])
def ours(request, folder, from_folder) -> LoadedModel:
    if request.param == "hf":
        return from_folder
    model_path = write_qwen_vl_gguf(folder, folder.parent / f"{folder.name}-gguf")
    return load_model(str(model_path), quantize="none")


def our_prompt(model: LoadedModel, prompt: str, image: Image.Image) -> tuple[list[int], Placed]:
    """The prompt's ids with the image's plan in place of the marker, and where it sits."""
    assert model.vision is not None
    plan = model.vision.plan(image)
    before, after = prompt.split(model.vision.marker)
    ids = model.tokenizer.encode(before + plan.text + after)
    return ids, Placed(ids.index(model.vision.image_token_id), plan)


def logits_with_image(model: LoadedModel, ids: list[int], image: Placed) -> torch.Tensor:
    """Next-token logits at every position, one prefill through the paged KV cache, the
    tower's rows in place of the placeholders and the row's M-RoPE positions."""
    assert model.vision is not None
    at = torch.arange(image.start, image.start + image.plan.n_tokens)
    rows = model.vision.encode(image.plan)
    mrope = lambda positions: step_mrope_positions(positions, [len(ids)], [[image]])  # noqa: E731
    return prompt_logits(model, ids, ImageRows(at, rows, mrope=mrope))


@pytest.mark.parametrize("size", SIZES)
def test_image_plan_gives_transformers_patches_grid_and_prompt(folder, from_folder, size):
    ours = from_folder
    image = random_image(*size)
    expected = reference_inputs(folder, PROMPT, image)
    assert ours.vision is not None
    plan = ours.vision.plan(image)
    assert torch.equal(plan.pixels.patches, expected["pixel_values"])
    assert list(plan.pixels.grid) == expected["image_grid_thw"][0].tolist()
    ids, _ = our_prompt(ours, PROMPT, image)
    assert ids == expected["input_ids"][0].tolist()
    assert sum(t == ours.vision.image_token_id for t in ids) == plan.n_tokens


def test_transparent_image_is_laid_over_white_as_transformers_does(folder, from_folder):
    ours = from_folder
    image = random_image(90, 150, "RGBA")
    expected = reference_inputs(folder, PROMPT, image)
    assert ours.vision is not None
    assert torch.equal(ours.vision.plan(image).pixels.patches, expected["pixel_values"])


@pytest.mark.parametrize("size", SIZES)
def test_vision_tower_output_matches_transformers(folder, ours, reference, size):
    image = random_image(*size)
    inputs = reference_inputs(folder, PROMPT, image)
    with torch.no_grad():
        features = reference.model.get_image_features(
            inputs["pixel_values"], inputs["image_grid_thw"]
        ).pooler_output
    expected = torch.cat(list(features))
    assert ours.vision is not None
    rows = ours.vision.encode(ours.vision.plan(image))
    assert rows.shape == expected.shape
    assert torch.allclose(rows, expected, atol=1e-4, rtol=0)


def test_image_positions_are_transformers_rope_index(folder, ours, reference):
    image = random_image(120, 200)
    inputs = reference_inputs(folder, PROMPT, image)
    expected, _ = reference.model.get_rope_index(
        inputs["input_ids"],
        inputs["mm_token_type_ids"],
        image_grid_thw=inputs["image_grid_thw"],
    )
    ids, placed = our_prompt(ours, PROMPT, image)
    got = step_mrope_positions(torch.arange(len(ids)), [len(ids)], [[placed]])
    assert got is not None
    assert torch.equal(got, expected[:, 0])


def test_merged_sequence_logits_match_transformers(folder, ours, reference):
    image = random_image(120, 200)
    inputs = reference_inputs(folder, PROMPT, image)
    with torch.no_grad():
        expected = reference(**inputs).logits[0]
    ids, placed = our_prompt(ours, PROMPT, image)
    got = logits_with_image(ours, ids, placed)
    assert torch.allclose(got, expected, atol=LOGIT_TOLERANCE, rtol=0)


def test_greedy_continuation_about_an_image_matches_transformers(folder, ours, reference):
    image = random_image(600, 400)
    inputs = reference_inputs(folder, PROMPT, image)
    with torch.no_grad():
        out = reference.generate(**inputs, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    expected = out[0, inputs["input_ids"].shape[1] :].tolist()
    ids, placed = our_prompt(ours, PROMPT, image)
    got: list[int] = []
    for _ in range(24):  # the whole sequence again each step: text after the image continues
        got.append(int(logits_with_image(ours, ids + got, placed)[-1].argmax()))
    assert got == expected


def test_text_alone_needs_no_mrope_positions(folder, ours, reference):
    ids = ours.tokenizer.encode("<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n")
    with torch.no_grad():
        expected = reference(input_ids=torch.tensor([ids])).logits[0]
    engine = Engine(ours, EngineConfig(batch=1))
    try:
        seq = Sequence.from_prompt(0, ids, SamplingParams())
        engine.block_manager.append_slots(seq, len(ids))
        batch = engine.runner.build_batch(
            SchedulerOutput(rows=[ScheduledRow(seq, 0, len(ids), True)])
        )
        batch.logits_index = torch.arange(len(ids))
        assert batch.mrope_positions is None
        got = ours.network(batch, engine.runner.kv)
    finally:
        engine.close()
    assert torch.allclose(got, expected, atol=LOGIT_TOLERANCE, rtol=0)


def test_qwen_vl_reads_images_from_the_folder_and_the_gguf_pair(ours):
    assert ours.vision is not None and ours.family.vision is True
    assert ours.family.name == "qwen2_5_vl"
    assert ours.vision.marker == "<|image_pad|>"
    assert ours.config.mrope_section == (2, 3, 3)


def test_template_shows_an_image_part_as_qwens_vision_placeholder(from_folder):
    """The family's template (the folder carries none; the tiny GGUF carries its donor's)."""
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look: "},
                {"type": "image"},
                {"type": "text", "text": " What is in the picture?"},
            ],
        }
    ]
    assert from_folder.tokenizer.render_chat(messages, add_generation_prompt=True) == PROMPT


def test_decoding_step_by_step_over_the_kv_cache_matches_transformers(
    folder, from_folder, reference
):
    """As the engine will run it: one prefill with the image, then one token a step, each
    step's M-RoPE positions from step_mrope_positions (the text after the image continues
    from the image's largest position, not from its index)."""
    model = from_folder
    assert model.vision is not None
    image = random_image(600, 400)
    inputs = reference_inputs(folder, PROMPT, image)
    with torch.no_grad():
        out = reference.generate(**inputs, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    expected = out[0, inputs["input_ids"].shape[1] :].tolist()
    ids, placed = our_prompt(model, PROMPT, image)
    engine = Engine(model, EngineConfig(batch=1))
    try:
        seq = Sequence.from_prompt(0, ids, SamplingParams())
        got: list[int] = []
        start, count = 0, len(ids)
        for _ in range(24):
            engine.block_manager.append_slots(seq, count)
            batch = engine.runner.build_batch(
                SchedulerOutput(rows=[ScheduledRow(seq, start, count, True)])
            )
            if start == 0:
                at = torch.arange(placed.start, placed.start + placed.plan.n_tokens)
                batch.embed_override = (at, model.vision.encode(placed.plan))
            batch.mrope_positions = step_mrope_positions(batch.positions, [count], [[placed]])
            token = int(model.network(batch, engine.runner.kv)[-1].argmax())
            got.append(token)
            seq.num_computed_tokens = start + count
            seq.append_token(token)
            start, count = seq.num_computed_tokens, 1
    finally:
        engine.close()
    assert got == expected


def test_int8_keeps_the_patch_embedding_whose_width_is_not_whole_blocks_in_float(
    folder, from_folder
):
    """3 x 2 x 14 x 14 = 1176 inputs are not whole 32-weight blocks: that linear stays F32,
    the others become Q8_0, and the tower still answers close to fp32."""
    model = load_model(str(folder), quantize="int8")
    assert model.vision is not None and from_folder.vision is not None
    image = random_image(120, 200)
    expected = from_folder.vision.encode(from_folder.vision.plan(image))
    rows = model.vision.encode(model.vision.plan(image))
    assert (rows - expected).abs().max() < 0.05 * expected.abs().max()
