"""Model discovery: where models are found, the ids they get, and what they will hold."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from synthetic_files import synthetic_gguf
from tiny_models import make_tiny_checkpoint

from modelhost.engine.kv.kv_pool_size import IDLE_KV_BYTES
from modelhost.inference.admission import working_bytes
from modelhost.models.loading.embedded import DEFAULT_MODEL, embedded_path
from modelhost.models.loading.hf_config import config_from_hf
from modelhost.models.loading.loader import load_model
from modelhost.residency.registry import ModelRegistry, ServingShape, hf_hub_dir


@pytest.fixture(scope="module")
def tiny(smollm2, tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny-llama", "llama", smollm2)


def hub_layout(hub: Path, org: str, name: str, checkpoint: Path) -> Path:
    repo = hub / f"models--{org}--{name}"
    snapshot = repo / "snapshots" / "abc123"
    shutil.copytree(checkpoint, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    return snapshot


def registry(tmp_path: Path, **options) -> ModelRegistry:
    options.setdefault("embedded", False)
    return ModelRegistry(home=tmp_path / "home", hf_hub=tmp_path / "hub", **options)


def test_a_hugging_face_cache_snapshot_is_listed_as_org_slash_name(tmp_path, tiny):
    snapshot = hub_layout(tmp_path / "hub", "acme", "tiny-llama", tiny)
    [entry] = registry(tmp_path).entries()
    assert (entry.id, entry.format, entry.architecture) == (
        "acme/tiny-llama",
        "safetensors",
        "llama",
    )
    assert entry.path == snapshot
    assert entry.weights_bytes == load_model(str(snapshot)).weights_bytes  # what it will hold
    assert entry.size_bytes == (tiny / "model.safetensors").stat().st_size


def test_models_under_modelhost_home_and_given_paths_keep_their_folder_names(tmp_path, tiny):
    shutil.copytree(tiny, tmp_path / "home" / "models" / "acme" / "nested")
    shutil.copytree(tiny, tmp_path / "home" / "models" / "flat")
    shutil.copytree(tiny, tmp_path / "elsewhere" / "given")
    found = registry(tmp_path, paths=[tmp_path / "elsewhere" / "given"]).entries()
    assert [e.id for e in found] == ["given", "acme/nested", "flat"]


def test_a_loose_gguf_file_is_listed_by_its_stem(tmp_path):
    models = tmp_path / "home" / "models"
    models.mkdir(parents=True)
    shutil.copy(embedded_path(DEFAULT_MODEL), models / "my-model.Q4.gguf")
    [entry] = registry(tmp_path).entries()
    assert (entry.id, entry.format, entry.architecture) == ("my-model.Q4", "gguf", "llama")
    # Packed in its own quantization: about the file (which also holds the vocabulary).
    assert entry.weights_bytes == load_model(str(entry.path)).weights_bytes
    assert 0.9 * entry.size_bytes < entry.weights_bytes < 1.05 * entry.size_bytes


def test_a_model_that_resolves_outside_its_root_is_not_listed(tmp_path, tiny):
    models = tmp_path / "home" / "models"
    models.mkdir(parents=True)
    (models / "escape").symlink_to(tiny, target_is_directory=True)
    reg = registry(tmp_path)
    assert reg.entries() == []
    assert reg.get("../tiny-llama") is None and reg.get(str(tiny)) is None


def test_the_embedded_models_are_listed_under_their_own_ids(tmp_path):
    ids = [e.id for e in ModelRegistry(home=tmp_path / "home", hf_hub=tmp_path / "hub").entries()]
    assert ids[:2] == [DEFAULT_MODEL, "gemma-3-270m"]


def test_the_estimate_is_the_weights_and_requests_claim_kv_and_working_memory(tmp_path, tiny):
    hub_layout(tmp_path / "hub", "acme", "tiny-llama", tiny)
    [entry] = registry(tmp_path).entries()
    kv_per_token = 2 * 3 * 2 * 16 * 2  # layers × kv heads × head dim × fp16, keys and values
    kv_pool = 8 * (512 + 8) * kv_per_token  # a full context and a block for every row
    config = config_from_hf(json.loads((tiny / "config.json").read_text()))
    work = working_bytes(config, 4, 512, chunk_tokens=512, rows=8)
    # Idle: the weights, and the prefix cache an idle engine keeps (here the whole small pool).
    assert entry.estimate_bytes == entry.weights_bytes + kv_pool
    assert (entry.work_bytes, entry.kv_row_bytes, entry.kv_pool_bytes) == (
        work,
        (512 + 8) * kv_per_token,
        kv_pool,
    )
    budgeted = registry(tmp_path, shape=ServingShape(memory_budget_bytes=10**9)).entries()[0]
    assert budgeted.kv_pool_bytes == 10**9 - budgeted.weights_bytes  # requests may take the rest
    assert budgeted.estimate_bytes < budgeted.weights_bytes + IDLE_KV_BYTES + 1


def test_a_1b_shaped_file_is_estimated_at_about_its_weights_not_weights_and_a_pool(tmp_path):
    # Llama 3.2 1B's widths, two of its layers and a narrow vocabulary: a small file.
    shape = replace(synthetic_gguf.SHAPES["1b"], vocab=1024)
    path = synthetic_gguf.write_synthetic_gguf(
        tmp_path / "one-b.gguf", shape, "Q4_K_M", layers=2, tokenizer=False
    )
    [entry] = registry(tmp_path, paths=[path]).entries()
    one_context = (8192 + 8) * 2 * 2 * 8 * 64 * 2  # layers × K and V × kv heads × dim × fp16
    assert entry.kv_row_bytes == one_context
    assert entry.kv_pool_bytes == 8 * one_context  # what eight rows may grow the pool to
    assert entry.estimate_bytes - entry.weights_bytes == IDLE_KV_BYTES  # idle: the kept cache


def test_a_path_given_to_serve_joins_the_registry(tmp_path, tiny):
    reg = registry(tmp_path)
    entry = reg.resolve_argument(str(tiny))
    assert entry is not None and entry.id == "tiny-llama"
    assert reg.get("tiny-llama") == entry
    assert reg.resolve_argument(str(tmp_path / "missing")) is None


def test_the_hugging_face_cache_is_where_huggingface_hub_keeps_it(monkeypatch, tmp_path):
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert hf_hub_dir() == tmp_path / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hf_hub_dir() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", "~/hf")
    assert hf_hub_dir() == tmp_path / "hf" / "hub"
    monkeypatch.setenv("HUGGINGFACE_HUB_CACHE", str(tmp_path / "old"))
    assert hf_hub_dir() == tmp_path / "old"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "new"))
    assert hf_hub_dir() == tmp_path / "new"
