"""Prompt logprobs in the engine: every prompt token scored, as the model predicts it."""

from __future__ import annotations

import math

import pytest

from modelhost.engine.engine import Engine, EngineConfig
from modelhost.engine.events import EngineEvent
from modelhost.engine.sampling.sampling_params import SamplingParams
from modelhost.models.loaded import LoadedModel

TEXT = "The quick brown fox jumps over the lazy dog, because the dog was asleep in the sun."


async def _events(engine: Engine, ids: list[int], params: SamplingParams) -> list[EngineEvent]:
    return [event async for event in engine.submit(ids, params)]


@pytest.fixture
def engine(smollm2: LoadedModel):
    # 16-token steps: the prompt is prefilled in several chunks.
    engine = Engine(smollm2, EngineConfig(batch=2, max_num_batched_tokens=16))
    yield engine
    engine.close()


async def test_each_prompt_token_is_scored_as_the_model_predicts_it_after_its_prefix(
    engine: Engine, smollm2: LoadedModel
) -> None:
    ids = smollm2.tokenizer.encode(TEXT)
    scored = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=True, logprobs=0)
    prompt = (await _events(engine, ids, scored))[0].prompt_logprobs
    assert prompt is not None
    assert [entry.token_id for entry in prompt] == ids
    assert math.isnan(prompt[0].logprob)  # nothing precedes the first token
    for k in (1, len(ids) // 2, len(ids) - 1):
        readout = SamplingParams(temperature=0, max_tokens=1, readout_token_ids=(ids[k],))
        event = (await _events(engine, ids[:k], readout))[0]
        assert event.logprobs is not None
        # The quantized linears take bf16 activations: a chunk of rows and a single row round
        # differently, by a few thousandths of a nat.
        assert prompt[k].logprob == pytest.approx(event.logprobs[0].top[0].logprob, abs=2e-2)


async def test_a_scored_prompt_is_computed_in_full_even_when_its_prefix_is_cached(
    engine: Engine, smollm2: LoadedModel
) -> None:
    ids = smollm2.tokenizer.encode(TEXT * 2)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=True)
    first = await _events(engine, ids, params)
    second = await _events(engine, ids, params)
    assert second[-1].usage is not None and second[-1].usage.cached_tokens == 0
    assert first[0].prompt_logprobs is not None and second[0].prompt_logprobs is not None
    assert [e.logprob for e in second[0].prompt_logprobs[1:]] == pytest.approx(
        [e.logprob for e in first[0].prompt_logprobs[1:]], abs=1e-4
    )


async def test_rows_without_prompt_logprobs_carry_none(
    engine: Engine, smollm2: LoadedModel
) -> None:
    ids = smollm2.tokenizer.encode(TEXT)
    events = await _events(engine, ids, SamplingParams(temperature=0, max_tokens=2))
    assert all(event.prompt_logprobs is None for event in events)
