"""Our architectures against the reference implementation (`transformers`, fp32).

Tolerance: prompt logits agree within 1e-3 absolute (observed ~2e-5 on both embedded models,
whose logits reach ~30), and greedy continuations are token-for-token equal.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
import transformers
from prompt_logits import prompt_logits
from tiny_models import ARCHITECTURES, make_tiny_checkpoint, reference_model

from modelhost.engine.engine import Engine, EngineConfig
from modelhost.engine.sampling_params import SamplingParams
from modelhost.models.loaded import LoadedModel
from modelhost.models.loader import load_model

LOGIT_TOLERANCE = 1e-3
EMBEDDED = {"smollm2": "smollm2-135m-instruct", "gemma3": "gemma-3-270m"}


def our_greedy(model: LoadedModel, prompt_ids: list[int], num_tokens: int) -> list[int]:
    async def run() -> list[int]:
        engine = Engine(model, EngineConfig(block_size=4))  # small blocks: many block crossings
        try:
            params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
            return [t async for event in engine.submit(prompt_ids, params) for t in event.token_ids]
        finally:
            engine.close()

    return asyncio.run(run())


def reference_greedy(reference: torch.nn.Module, prompt_ids: list[int], num_tokens: int):
    with torch.no_grad():
        out = reference.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=num_tokens,
            min_new_tokens=num_tokens,
            do_sample=False,
        )
    return out[0, len(prompt_ids) :].tolist()


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def tiny(request, tmp_path_factory, smollm2):
    directory = tmp_path_factory.mktemp(request.param)
    make_tiny_checkpoint(directory, request.param, smollm2)
    return load_model(str(directory), quantize="none"), reference_model(directory)


def test_tiny_checkpoint_prompt_logits_match_transformers(tiny, smollm2):
    ours, reference = tiny
    prompt = smollm2.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0]
    got = prompt_logits(ours, prompt)
    assert torch.allclose(got, expected, atol=LOGIT_TOLERANCE, rtol=0)


def test_tiny_checkpoint_greedy_continuation_matches_transformers(tiny, smollm2):
    ours, reference = tiny
    prompt = smollm2.tokenizer.encode("Once upon a time there was")
    assert our_greedy(ours, prompt, 24) == reference_greedy(reference, prompt, 24)


def _gguf_reference(model: LoadedModel) -> torch.nn.Module:
    path = Path(model.path)
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_embedded_model_matches_transformers_on_the_same_gguf(name):
    # fp32 linears: the quantized modes are held to perplexity instead (tests/models/test_quant.py).
    model = load_model(EMBEDDED[name], quantize="none")
    reference = _gguf_reference(model)
    prompt = model.tokenizer.encode("The history of the Roman Empire begins")
    assert our_greedy(model, prompt, 32) == reference_greedy(reference, prompt, 32)
    # A prompt past Gemma's 512-token sliding window checks the local layers too.
    long_prompt = model.tokenizer.encode("Rome was not built in a day, they say. " * 60)
    assert len(long_prompt) > 520
    with torch.no_grad():
        expected = reference(torch.tensor([long_prompt])).logits[0]
    got = prompt_logits(model, long_prompt)
    assert torch.allclose(got, expected, atol=LOGIT_TOLERANCE, rtol=0)
