"""Real vision towers through the engine: Qwen2.5-VL's M-RoPE positions in every step the
engine builds (the prefill, its chunks, and each decode step after the image), against
transformers' greedy continuation on a tiny random checkpoint."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from PIL import Image
from tiny_qwen_vl import make_tiny_qwen_vl, reference_inputs, reference_qwen_vl

from modelhost.engine.engine import Engine, EngineConfig
from modelhost.engine.sampling.sampling_params import SamplingParams
from modelhost.engine.sequence import ImageSpan
from modelhost.models.loaded import LoadedModel
from modelhost.models.loading.loader import load_model

PROMPT = (
    "<|im_start|>user\nLook: <|vision_start|><|image_pad|><|vision_end|> What is in the "
    "picture?<|im_end|>\n<|im_start|>assistant\n"
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def random_image(height: int, width: int) -> Image.Image:
    rng = np.random.default_rng(height * 1000 + width)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory, smollm2):
    return make_tiny_qwen_vl(tmp_path_factory.mktemp("qwen_vl_engine"), smollm2)


@pytest.fixture(scope="module")
def qwen(qwen_folder) -> LoadedModel:
    return load_model(str(qwen_folder), quantize="none")


def transformers_greedy(folder, image: Image.Image) -> list[int]:
    reference = reference_qwen_vl(folder)
    inputs = reference_inputs(folder, PROMPT, image)
    with torch.no_grad():
        out = reference.generate(**inputs, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def placed(model: LoadedModel, image: Image.Image) -> tuple[list[int], ImageSpan]:
    assert model.vision is not None
    plan = model.vision.plan(image)
    before, after = PROMPT.split(model.vision.marker)
    ids = model.tokenizer.encode(before + plan.text + after)
    positions = tuple(i for i, token in enumerate(ids) if token == model.vision.image_token_id)
    digest = hashlib.sha256(image.tobytes()).digest()
    span = ImageSpan(positions[0], positions[-1] - positions[0] + 1, digest, plan, positions)
    return ids, span


async def generate(model: LoadedModel, ids: list[int], span: ImageSpan, chunk: int) -> list[int]:
    config = EngineConfig(batch=2, kv_cache_bytes=16 << 20, max_num_batched_tokens=chunk)
    engine = Engine(model, config)
    try:
        events = [event async for event in engine.submit(ids, GREEDY, (span,))]
    finally:
        engine.close()
    return [token for event in events for token in event.token_ids]


async def test_qwen_vl_through_the_engine_gives_transformers_greedy_tokens(qwen_folder, qwen):
    image = random_image(600, 400)
    ids, span = placed(qwen, image)
    expected = transformers_greedy(qwen_folder, image)
    assert await generate(qwen, ids, span, chunk=512) == expected
    # A prefill chunked through the image (chunks of 16 tokens) decodes the same.
    assert span.length > 16
    assert await generate(qwen, ids, span, chunk=16) == expected
