"""Next-token logits at every prompt position, from one prefill through the engine's paged KV
cache: what the parity and quantization tests compare against their references."""

from __future__ import annotations

import torch

from modelhost.engine.engine import Engine, EngineConfig
from modelhost.engine.sampling.sampling_params import SamplingParams
from modelhost.engine.scheduler import ScheduledRow, SchedulerOutput
from modelhost.engine.sequence import Sequence
from modelhost.models.loaded import LoadedModel


def prompt_logits(model: LoadedModel, prompt_ids: list[int]) -> torch.Tensor:
    engine = Engine(model, EngineConfig(batch=1))
    try:
        seq = Sequence.from_prompt(0, prompt_ids, SamplingParams())
        engine.block_manager.append_slots(seq, len(prompt_ids))
        batch = engine.runner.build_batch(
            SchedulerOutput(rows=[ScheduledRow(seq, 0, len(prompt_ids), True)])
        )
        batch.logits_index = torch.arange(len(prompt_ids))
        return model.network(batch, engine.runner.kv)
    finally:
        engine.close()
