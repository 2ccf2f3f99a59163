"""Suite-wide fixtures: one MODELHOST_HOME for the run and the embedded models, loaded once."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

# Converted models are cached under MODELHOST_HOME; a repo-local one keeps the suite off the
# user's home and lets later runs skip the one-time GGUF conversion. Each pytest-xdist worker
# (PYTEST_XDIST_WORKER is set before this file loads) has its own, so one worker's KV store or
# converted files never show in another's tests; a worker inherits the controller's "main".
_REPO_HOME = Path(__file__).resolve().parents[1] / ".modelhost"
if os.environ.get("MODELHOST_HOME") in (None, str(_REPO_HOME / "main")):
    os.environ["MODELHOST_HOME"] = str(_REPO_HOME / os.environ.get("PYTEST_XDIST_WORKER", "main"))

import torch  # noqa: E402

from modelhost.engine.engine import share_the_gil_with_the_engine  # noqa: E402
from modelhost.models.loaded import LoadedModel  # noqa: E402
from modelhost.models.loading.embedded import EMBEDDED  # noqa: E402
from modelhost.models.loading.loader import load_model  # noqa: E402
from modelhost.paths import file_cache_key, modelhost_home  # noqa: E402

# The engine, the event loop and test clients share two cores here; a second intra-op thread
# spinning against them makes every matmul many times slower, and tests measure no speed.
torch.set_num_threads(1)
share_the_gil_with_the_engine()  # as `modelhost serve` does where its engines run


# Folders that session-scoped fixtures make once for every module (`models_dir`, pull_world.py).
_SESSION_FOLDERS = ("models", "hub-files")


@pytest.fixture(autouse=True, scope="module")
def _module_leaves_no_disk_behind(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A module's temporary folders, and the packed copies of the GGUF files it wrote there,
    go when its last fixture has: a whole run otherwise leaves ~12 GB behind, more than a CI
    machine's disk may have free (tests' own folders go as each passes: pyproject's
    tmp_path_retention_policy). The embedded models' packed copies stay for the next module."""
    base = tmp_path_factory.getbasetemp()
    packed = modelhost_home() / "cache" / "gguf"
    folders_before = set(base.iterdir())
    packed_before = set(packed.iterdir()) if packed.is_dir() else set()
    yield
    for folder in set(base.iterdir()) - folders_before:
        if not folder.name.startswith(_SESSION_FOLDERS):
            shutil.rmtree(folder, ignore_errors=True)
    embedded = {file_cache_key(locate()) for locate in EMBEDDED.values()}
    for folder in (set(packed.iterdir()) if packed.is_dir() else set()) - packed_before:
        if folder.name not in embedded:
            shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    return load_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def gemma3() -> LoadedModel:
    return load_model("gemma-3-270m")


@pytest.fixture(scope="session")
def models_dir(smollm2: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two tiny checkpoints of known sizes (SmolLM2's tokenizer, random weights)."""
    from tiny_models import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("models")
    make_tiny_checkpoint(root / "tiny-a", "llama", smollm2)
    make_tiny_checkpoint(root / "tiny-b", "qwen2", smollm2)
    return root
