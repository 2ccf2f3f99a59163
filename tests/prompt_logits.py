"""Next-token logits at every prompt position, from one prefill through the engine's paged KV
cache: what the parity and quantization tests compare against their references, with an
image's rows in place of its placeholders where a vision test gives them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from modelhost.engine.engine import Engine, EngineConfig
from modelhost.engine.sampling.sampling_params import SamplingParams
from modelhost.engine.scheduler import ScheduledRow, SchedulerOutput
from modelhost.engine.sequence import Sequence
from modelhost.models.loaded import LoadedModel


@dataclass
class ImageRows:
    """A tower's output for the placeholder positions `at` of one prompt."""

    at: torch.Tensor
    rows: torch.Tensor
    both_ways: bool = False  # the image's tokens attend to each other both ways (Gemma 3)
    mrope: Callable[[torch.Tensor], torch.Tensor] | None = None  # positions -> M-RoPE (Qwen)


def placeholders(ids: list[int], token_id: int) -> torch.Tensor:
    return torch.tensor([i for i, t in enumerate(ids) if t == token_id])


def prompt_logits(
    model: LoadedModel, prompt_ids: list[int], image: ImageRows | None = None
) -> torch.Tensor:
    engine = Engine(model, EngineConfig(batch=1))
    try:
        seq = Sequence.from_prompt(0, prompt_ids, SamplingParams())
        engine.block_manager.append_slots(seq, len(prompt_ids))
        batch = engine.runner.build_batch(
            SchedulerOutput(rows=[ScheduledRow(seq, 0, len(prompt_ids), True)])
        )
        batch.logits_index = torch.arange(len(prompt_ids))
        if image is not None:
            batch.embed_override = (image.at, image.rows)
            if image.mrope is not None:
                batch.mrope_positions = image.mrope(batch.positions)
            if image.both_ways:  # the block ORed into the masks, as the engine does
                block = torch.zeros_like(batch.attn_mask)
                block[0, 0, image.at[:, None], image.at[None, :]] = True
                batch.attn_mask = batch.attn_mask | block
                if batch.sliding_mask is not None:
                    batch.sliding_mask = batch.sliding_mask | block
                batch.bidirectional = True
        return model.network(batch, engine.runner.kv)
    finally:
        engine.close()
