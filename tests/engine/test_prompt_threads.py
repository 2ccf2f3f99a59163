"""`EngineConfig.prompt_threads`: prompt-heavy steps on more intra-op threads; decode steps too
where PyTorch's matmuls, not the native kernels, stream the weights."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from modelhost.engine import runner
from modelhost.engine.engine import Engine, EngineConfig
from modelhost.engine.runner import PROMPT_THREADS_MIN_TOKENS
from modelhost.engine.sampling.sampling_params import SamplingParams
from modelhost.models.loaded import LoadedModel


async def threads_per_step(
    smollm2: LoadedModel, monkeypatch: pytest.MonkeyPatch, prompt_threads: int
) -> list[tuple[int, int]]:
    """(tokens in the step, threads while it ran) for a long prompt and 4 tokens."""
    network = smollm2.network
    seen: list[tuple[int, int]] = []

    def recording_forward(batch, kv, before_layers):
        seen.append((batch.input_ids.numel(), torch.get_num_threads()))
        return type(network).forward(network, batch, kv, before_layers)

    monkeypatch.setattr(network, "forward", recording_forward)
    # No speculation: a repeated prompt invites guesses, and a step verifying them (whether
    # `auto` guesses depends on measured step times) is not the one-token decode step counted.
    config = EngineConfig(batch=2, prompt_threads=prompt_threads, speculate="none")
    engine = Engine(smollm2, config)
    try:
        prompt = smollm2.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 12)
        assert len(prompt) >= PROMPT_THREADS_MIN_TOKENS
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        events = [event async for event in engine.submit(prompt, params)]
    finally:
        engine.close()
    assert sum(len(event.token_ids) for event in events) == 4
    assert seen[0][0] == len(prompt) and len(seen) > 1
    return seen


async def test_with_native_kernels_decode_steps_stay_on_the_serving_threads(
    smollm2: LoadedModel, monkeypatch: pytest.MonkeyPatch
):
    kernels = SimpleNamespace(threads=1)  # the runner only hands the kernels their threads
    monkeypatch.setattr(runner, "native", SimpleNamespace(kernels=lambda: kernels))
    serving_threads = torch.get_num_threads()
    # The count a new thread (the engine's) starts with is the process's default, which any
    # engine's prompt step moves while it runs: set it back to this thread's count first.
    torch.set_num_threads(serving_threads)
    seen = await threads_per_step(smollm2, monkeypatch, serving_threads + 1)
    assert kernels.threads == serving_threads + 1
    assert seen[0][1] == serving_threads + 1
    assert all(step == (1, serving_threads) for step in seen[1:]), seen


async def test_without_native_kernels_every_step_runs_on_the_prompt_threads(
    smollm2: LoadedModel, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(runner, "native", SimpleNamespace(kernels=lambda: None))
    serving_threads = torch.get_num_threads()
    seen = await threads_per_step(smollm2, monkeypatch, serving_threads + 1)
    assert all(threads == serving_threads + 1 for _, threads in seen)
    assert torch.get_num_threads() == serving_threads
