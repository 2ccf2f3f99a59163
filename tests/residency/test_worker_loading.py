"""A worker's load as the front sees it: its progress, its quantization mode, the draft model
it loads beside its model, and a model that cannot be served at all."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType
from synthetic_files import retype_tensor, write_tiny

from modelhost.assembly import worker_loader
from modelhost.residency.registry import ModelRegistry
from modelhost.residency.unit import LoadProgress
from modelhost.server.settings import ServeSettings

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_f16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny(tmp_path_factory.mktemp("worker-loading") / "tiny-f16.gguf", "F16")


def entry_for(path: Path, home: Path):
    registry = ModelRegistry([path], home=home / "home", hf_hub=home / "hub", embedded=False)
    entry = registry.get(path.stem)
    assert entry is not None
    return entry


async def weights_held(path: Path, home: Path, quantize: str | None) -> tuple[int, LoadProgress]:
    progress = LoadProgress(path.stem)
    unit = await worker_loader(ServeSettings(), batch=2, quantize=quantize)(
        entry_for(path, home), progress
    )
    try:
        stats = await unit.get_json("/stats")
        assert stats is not None
        return int(stats["admission"]["weights_bytes"]), progress
    finally:
        await unit.close()


async def test_a_worker_tells_the_front_how_far_its_load_has_got(tiny_f16, tmp_path):
    _, progress = await weights_held(tiny_f16, tmp_path, None)
    assert progress.fraction == pytest.approx(1.0, abs=0.02)


async def test_a_worker_holds_its_weights_in_the_mode_quantize_names(tiny_f16, tmp_path):
    as_stored, _ = await weights_held(tiny_f16, tmp_path, None)
    in_int8, _ = await weights_held(tiny_f16, tmp_path, "int8")
    assert in_int8 < 0.6 * as_stored  # Q8_0's 8.5 bits a weight against F16's 16


async def test_a_worker_loads_the_draft_model_beside_its_model_and_says_so(tiny_f16, tmp_path):
    draft = write_tiny(tmp_path / "tiny-draft.gguf", "F16", layers=1)  # SmolLM2's vocabulary too
    settings = ServeSettings(
        speculate="draft", draft_model_id="tiny-draft", draft_model_path=str(draft)
    )
    unit = await worker_loader(settings, batch=2)(entry_for(tiny_f16, tmp_path), LoadProgress("x"))
    try:
        stats = await unit.get_json("/stats")
        assert stats is not None
        assert stats["speculation"]["mode"] == "draft"
        assert stats["speculation"]["draft_model"] == "tiny-draft"
    finally:
        await unit.close()


def test_serve_refuses_a_startup_model_with_a_tensor_type_it_cannot_run(tmp_path):
    path = write_tiny(tmp_path / "tiny-iq.gguf", "Q4_0")
    retype_tensor(path, "blk.0.attn_q.weight", GGMLQuantizationType.IQ4_NL)
    done = subprocess.run(
        [sys.executable, "-m", "modelhost", "serve", str(path), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "tiny-iq cannot be served: tensor blk.0.attn_q.weight is IQ4_NL" in done.stderr
