"""A unit that serves its model inside this process: a generative model's InferenceStage over
its own Engine, or a companion's stage (a sentence encoder, a Whisper transcriber).

`--in-process` mode: every resident model has its own engine thread and KV pool here. Closing
the unit ends its requests (none, when the host evicts: a leased model is never evicted), stops
the engine thread and drops the weights.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

from modelhost.residency.companions import open_stage
from modelhost.residency.unit import LoadProgress

if TYPE_CHECKING:
    from modelhost.inference.stage import InferenceStage
    from modelhost.models.loaded import LoadedModel
    from modelhost.residency.registry import ModelEntry


class Stage(Protocol):
    """What a unit needs of whatever serves its model."""

    @property
    def model_id(self) -> str: ...
    def resident_bytes(self) -> int: ...
    def close(self) -> None: ...


class InProcessUnit:
    resumed = False  # prompts saved in the KV store come back per request, not at load

    def __init__(self, stage: Stage, load_ms: float = 0.0) -> None:
        self.stage = stage
        self.load_ms = load_ms
        self._closed = False

    @property
    def model_id(self) -> str:
        return self.stage.model_id

    def measured_bytes(self) -> int | None:
        """What this unit holds: its weights and, for a generative model, the memory its KV
        pool holds now (it grows with use and shrinks when idle)."""
        if self._closed:
            return None
        return self.stage.resident_bytes()

    async def refresh(self) -> None:
        return None  # the reading above is always current

    async def give_back_idle_memory(self) -> None:
        give_back = getattr(self.stage, "give_back_idle_memory", None)  # a KV pool's
        if give_back is not None and not self._closed:
            await asyncio.to_thread(give_back)

    def broken(self) -> bool:
        return False

    def pause(self) -> None:
        return None  # requests wait at the engine's own queue

    def resume(self) -> None:
        return None

    def interrupt(self) -> None:
        """End every request now (a forced shutdown); callable from any thread."""
        self.stage.close()

    async def close(self) -> bool:
        if not self._closed:
            self._closed = True
            await asyncio.to_thread(self.stage.close)
            await asyncio.to_thread(_release_memory)
        return True  # the engine wrote its prompt cache to the KV store (if any) as it closed


def _release_memory() -> None:
    gc.collect()  # the engine thread is gone; its tensors go with the last reference
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def in_process_loader(
    load_model: Callable[..., LoadedModel],
    build_stage: Callable[[LoadedModel], InferenceStage],
) -> Callable[[ModelEntry, LoadProgress], Awaitable[InProcessUnit]]:
    """The host's `load`: read the entry's files and start an engine (or open a companion),
    off the event loop. `load_model(path, progress=...)` reports the fraction it has read."""

    def load_sync(entry: ModelEntry, progress: LoadProgress) -> InProcessUnit:
        started = time.perf_counter()

        def load(path: str) -> LoadedModel:
            if entry.mmproj is not None:  # named by `serve --mmproj`
                return load_model(path, progress=progress.report, mmproj=entry.mmproj)
            return load_model(path, progress=progress.report)

        stage = open_stage(entry.path, entry.id, entry.operations, load, build_stage)
        return InProcessUnit(stage, (time.perf_counter() - started) * 1000)

    async def load(entry: ModelEntry, progress: LoadProgress) -> InProcessUnit:
        return await asyncio.to_thread(load_sync, entry, progress)

    return load
