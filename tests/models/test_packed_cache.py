"""A GGUF's repacked weights kept on disk (models/loading/packed_cache.py) and mapped again by the
next load of the same file."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from synthetic_files import write_tiny
from tiny_gguf import write_gguf_from_hf
from tiny_models import make_tiny_checkpoint

from modelhost.engine.engine import Engine, EngineConfig
from modelhost.engine.sampling.sampling_params import SamplingParams
from modelhost.models.kernels import native
from modelhost.models.kernels.packed import PackedWeight
from modelhost.models.loaded import LoadedModel
from modelhost.models.loading import packed_cache
from modelhost.models.loading.loader import load_model
from modelhost.paths import file_cache_key

pytestmark = pytest.mark.skipif(native.kernels() is None, reason="no native kernels here")


def load_and_keep(path: Path) -> LoadedModel:
    """Loads `path` and waits for its packed weights to be written, and written back."""
    model = load_model(str(path))
    for name in ("packed-weights-writer", "packed-weights-sync"):
        for thread in threading.enumerate():
            if thread.name == name:
                thread.join()
    return model


def mark(kept: Path, state: bytes, boot: str) -> None:
    """Sets a packed file's state and the boot that wrote it, as a writer would have."""
    with kept.open("r+b") as handle:
        handle.seek(len(packed_cache.MAGIC))
        handle.write(state + boot.encode().ljust(packed_cache.BOOT_BYTES, b"\0"))


def state_of(kept: Path) -> bytes:
    with kept.open("rb") as handle:
        handle.seek(len(packed_cache.MAGIC))
        return handle.read(8)


def cache_folder(path: Path) -> Path:
    return Path(os.environ["MODELHOST_HOME"]) / "cache" / "gguf" / file_cache_key(path)


def packed_file(path: Path) -> Path:
    (found,) = cache_folder(path).glob("packed-*.bin")
    return found


def greedy(model: LoadedModel) -> list[tuple[int, float]]:
    """12 greedy tokens of one prompt with their logprobs."""

    async def run() -> list[tuple[int, float]]:
        engine = Engine(model, EngineConfig())
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
        tokens = []
        try:
            async for event in engine.submit(model.tokenizer.encode("The capital of"), params):
                tokens += [(lp.token_id, lp.logprob) for lp in event.logprobs or []]
        finally:
            engine.close()
        return tokens

    return asyncio.run(run())


def refuse_repacking(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("repacked although the packed weights were on disk")

    monkeypatch.setattr(PackedWeight, "repack", refuse)
    monkeypatch.setattr(native.Kernels, "repack", refuse)


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    return write_tiny(tmp_path / "tiny-q4_k_m.gguf", "Q4_K_M")


def test_a_second_load_maps_the_packed_weights_and_answers_as_the_first(tiny, monkeypatch):
    first = greedy(load_and_keep(tiny))
    assert packed_file(tiny).stat().st_size > tiny.stat().st_size // 2
    refuse_repacking(monkeypatch)
    again = greedy(load_model(str(tiny)))
    assert len(again) == 12
    assert again == first


def test_a_torn_packed_file_is_removed_and_the_weights_repacked(tiny):
    first = greedy(load_and_keep(tiny))
    kept = packed_file(tiny)
    with kept.open("r+b") as handle:
        handle.truncate(kept.stat().st_size - 4096)
    torn_size = kept.stat().st_size
    assert greedy(load_and_keep(tiny)) == first
    assert kept.stat().st_size == torn_size + 4096  # removed, then written whole again


def test_a_foreign_file_in_the_packed_files_place_is_never_mapped(tiny):
    first = greedy(load_and_keep(tiny))
    kept = packed_file(tiny)
    size = kept.stat().st_size
    kept.write_bytes(b"not packed weights" * 1000)
    assert greedy(load_and_keep(tiny)) == first
    assert kept.stat().st_size == size


def test_no_packed_file_is_kept_with_a_budget_of_zero(tiny, monkeypatch):
    monkeypatch.setenv("MODELHOST_WEIGHTS_CACHE_GB", "0")
    load_and_keep(tiny)
    assert not list(cache_folder(tiny).glob("packed-*"))


def test_the_budget_removes_the_least_recently_loaded_file_first(tmp_path, monkeypatch):
    first = write_tiny(tmp_path / "first.gguf", "Q4_K_M")
    second = write_tiny(tmp_path / "second.gguf", "Q8_0")
    load_and_keep(first)
    one = packed_file(first).stat().st_size
    load_and_keep(second)
    two = packed_file(second).stat().st_size
    load_and_keep(first)  # the first is now the more recently loaded
    third = write_tiny(tmp_path / "third.gguf", "Q4_K_M")
    monkeypatch.setenv("MODELHOST_WEIGHTS_CACHE_GB", str((one + max(one, two) + 4096) / 1e9))
    load_and_keep(third)
    assert packed_file(first).exists()
    assert packed_file(third).exists()
    with pytest.raises(ValueError):
        packed_file(second)


def test_a_half_written_file_of_a_process_that_ended_is_removed(tiny):
    load_and_keep(tiny)
    folder = packed_file(tiny).parent
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)  # fmt: skip
    abandoned = folder / f"{packed_file(tiny).name}.partial-{int(ended.stdout)}"
    abandoned.write_bytes(b"half")
    load_and_keep(tiny)
    assert not abandoned.exists()


def test_a_packed_file_is_marked_synced_once_written_back(tiny):
    load_and_keep(tiny)
    assert state_of(packed_file(tiny)) == packed_cache.SYNCED


def test_a_file_written_in_this_boot_but_not_yet_synced_is_mapped_and_then_synced(
    tiny, monkeypatch
):
    first = greedy(load_and_keep(tiny))
    kept = packed_file(tiny)
    mark(kept, packed_cache.WRITTEN, packed_cache._boot_id())
    refuse_repacking(monkeypatch)
    assert greedy(load_and_keep(tiny)) == first
    assert state_of(kept) == packed_cache.SYNCED


def test_a_file_never_synced_before_the_machine_restarted_is_removed_and_repacked(tiny):
    first = greedy(load_and_keep(tiny))
    kept = packed_file(tiny)
    mark(kept, packed_cache.WRITTEN, "a-boot-before-this-one")
    assert greedy(load_and_keep(tiny)) == first
    assert state_of(kept) == packed_cache.SYNCED  # written again, whole


def test_a_mixture_of_experts_maps_each_expert_as_its_own_weight(tmp_path, smollm2, monkeypatch):
    # Its experts are slices of one stored tensor a layer: keyed by the file's name alone,
    # every expert would have come back as the first.
    checkpoint = make_tiny_checkpoint(tmp_path / "moe", "qwen3_moe", smollm2)
    path = write_gguf_from_hf(checkpoint, tmp_path / "tiny-qwen3moe-q8_0.gguf", "Q8_0")
    first = load_and_keep(path)
    answer = greedy(first)
    refuse_repacking(monkeypatch)
    again = load_model(str(path))
    assert again.weights_bytes == first.weights_bytes
    assert greedy(again) == answer
