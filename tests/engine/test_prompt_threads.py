"""`EngineConfig.prompt_threads`: prompt-heavy steps on more intra-op threads, decode steps not."""

from __future__ import annotations

import torch

from modelhost.engine.engine import Engine, EngineConfig
from modelhost.engine.runner import PROMPT_THREADS_MIN_TOKENS
from modelhost.engine.sampling_params import SamplingParams
from modelhost.models.loaded import LoadedModel


async def test_a_long_prompt_step_runs_on_the_prompt_threads_and_decode_steps_on_the_others(
    smollm2: LoadedModel, monkeypatch
):
    network = smollm2.network
    seen: list[tuple[int, int]] = []  # (prompt tokens in the step, threads while it ran)

    def recording_forward(batch, kv):
        prompt = 0 if batch.prompt_index is None else batch.prompt_index.numel()
        seen.append((prompt, torch.get_num_threads()))
        return type(network).forward(network, batch, kv)

    monkeypatch.setattr(network, "forward", recording_forward)
    serving_threads = torch.get_num_threads()
    engine = Engine(smollm2, EngineConfig(batch=2, prompt_threads=serving_threads + 1))
    try:
        prompt = smollm2.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 12)
        assert len(prompt) >= PROMPT_THREADS_MIN_TOKENS
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        events = [event async for event in engine.submit(prompt, params)]
    finally:
        engine.close()
    assert sum(len(event.token_ids) for event in events) == 4
    assert seen[0] == (len(prompt), serving_threads + 1)
    assert seen[1:] and all(step == (0, serving_threads) for step in seen[1:])
