"""Readouts for typed decisions: a row's raw logprobs of given ids, and rows submitted as one
unit that the engine admits in the same step."""

from __future__ import annotations

import asyncio

import torch

from modelhost.engine.engine import Engine, EngineConfig
from modelhost.engine.sampling.sampler import RowSamplingState, sample
from modelhost.engine.sampling.sampling_params import SamplingParams
from modelhost.models.loaded import LoadedModel


def test_a_readout_row_gets_the_raw_logprobs_of_its_ids_in_the_given_order() -> None:
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0))
    expected = torch.log_softmax(logits, dim=-1)
    rows = [
        RowSamplingState.create(SamplingParams(temperature=0.0, readout_token_ids=(7, 3, 41)), [1]),
        RowSamplingState.create(SamplingParams(temperature=0.0), [1]),
    ]
    readout, plain = sample(logits.clone(), rows)
    assert readout.top_ids == [7, 3, 41]
    torch.testing.assert_close(torch.tensor(readout.top_logprobs), expected[0, [7, 3, 41]])
    assert plain.logprob is None and plain.top_ids == []


def test_a_readout_id_outside_the_vocabulary_reads_as_impossible() -> None:
    row = RowSamplingState.create(SamplingParams(readout_token_ids=(1, 500)), [1])
    (token,) = sample(torch.zeros(1, 10), [row])
    assert token.top_logprobs[1] == float("-inf")


async def test_rows_submitted_together_are_answered_in_one_step(smollm2: LoadedModel) -> None:
    engine = Engine(smollm2, EngineConfig(batch=4))
    try:
        prompts = [smollm2.tokenizer.encode(f"Question {i}: is the sky blue?") for i in range(3)]
        params = SamplingParams(temperature=0.0, max_tokens=1, readout_token_ids=(1, 2))
        before = engine.stats().steps
        streams = engine.submit_many([(ids, params) for ids in prompts])
        events = await asyncio.gather(*(anext(stream) for stream in streams))
        assert engine.stats().steps - before == 1
        assert all(event.finish_reason is not None and event.logprobs for event in events)
    finally:
        engine.close()
