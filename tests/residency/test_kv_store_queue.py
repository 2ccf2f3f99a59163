"""The prefix KV store's writer queue is memory the budget counts: blocks copied out of the pool
and waiting for the disk are in what an in-process model holds until they are written, the
queue never grows past its bound (a block past it is not persisted then, and the answer is the
same), and a busy model's claim reserves that bound when the store is on."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from modelhost.assembly import build_stage
from modelhost.engine.kv.kv_pool_size import store_queue_bytes
from modelhost.engine.sampling.sampling_params import SamplingParams
from modelhost.models.loaded import LoadedModel
from modelhost.residency.inprocess import InProcessUnit
from modelhost.residency.kv.kv_store import KVDiskStore, ModelKVStore
from modelhost.residency.registry import ModelRegistry, ServingShape
from modelhost.residency.unit import claim_bytes
from modelhost.server.settings import ServeSettings

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
QUEUED_BLOCKS = 3  # the queue's bound in these tests, in blocks


def long_prompt(model: LoadedModel) -> list[int]:
    text = " ".join(f"item {i} is {'red' if i % 3 else 'blue'}," for i in range(60))
    return model.tokenizer.encode(f"Remember this list: {text} Which item came first?")


def wait_until(done, what: str) -> None:
    deadline = time.monotonic() + 60
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"never {what}")
        time.sleep(0.01)


async def test_blocks_waiting_for_the_writer_count_in_what_the_model_holds_until_written(
    smollm2: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MODELHOST_HOME", str(tmp_path))
    disk_open = threading.Event()  # the writer's first write waits until the test opens it
    real_put = ModelKVStore.put

    def slow_put(self: ModelKVStore, *args) -> None:  # type: ignore[no-untyped-def]
        disk_open.wait(60)
        real_put(self, *args)

    monkeypatch.setattr(ModelKVStore, "put", slow_put)
    stage = build_stage(smollm2, ServeSettings(kv_disk_bytes=1 << 30), batch=2)
    unit = InProcessUnit(stage)
    try:
        persistence = stage.engine.persistence
        assert persistence is not None
        block = persistence.block_bytes
        persistence.queue_bytes = QUEUED_BLOCKS * block
        prompt = long_prompt(smollm2)
        assert len(prompt) // 8 > 2 * QUEUED_BLOCKS
        cold = [t async for event in stage.engine.submit(prompt, GREEDY) for t in event.token_ids]

        pool = stage.engine.stats().kv_committed_bytes
        queued = stage.engine.stats().kv_store_queued_bytes
        assert queued == QUEUED_BLOCKS * block  # full, and no further
        assert persistence.num_skipped_blocks > 0
        assert unit.measured_bytes() == smollm2.weights_bytes + pool + queued

        disk_open.set()
        wait_until(lambda: stage.engine.stats().kv_store_queued_bytes == 0, "written")
        assert unit.measured_bytes() == smollm2.weights_bytes + pool
        assert KVDiskStore(budget_bytes=1 << 30).usage().files == QUEUED_BLOCKS

        again = [t async for event in stage.engine.submit(prompt, GREEDY) for t in event.token_ids]
        assert again == cold  # skipped blocks cost nothing but their persistence
    finally:
        disk_open.set()
        await unit.close()
    # Closing wrote the blocks the queue had no room for, from the pool's cache.
    assert KVDiskStore(budget_bytes=1 << 30).usage().files >= len(prompt) // 8 - 1


def test_a_busy_models_claim_reserves_the_writer_queue_only_when_the_store_is_on(
    tmp_path: Path,
) -> None:
    def entry(kv_store: bool):  # type: ignore[no-untyped-def]
        shape = ServingShape(batch=2, kv_store=kv_store)
        registry = ModelRegistry(home=tmp_path / "home", hf_hub=tmp_path / "hub", shape=shape)
        found = registry.get("smollm2-135m-instruct")
        assert found is not None
        return found

    on, off = entry(True), entry(False)
    assert on.estimate_bytes == off.estimate_bytes  # an idle model copies nothing out
    assert claim_bytes(on, 0) == claim_bytes(off, 0) == 0
    for rows in (1, 2):
        assert claim_bytes(on, rows) == claim_bytes(off, rows) + store_queue_bytes(on.kv_pool_bytes)
    assert store_queue_bytes(on.kv_pool_bytes) == 64 << 20  # a pool of 1 GiB or more
