"""Two tiny checkpoints of known sizes, shared by the end-to-end residency tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import make_tiny_checkpoint


@pytest.fixture(scope="session")
def models_dir(smollm2, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("models")
    make_tiny_checkpoint(root / "tiny-a", "llama", smollm2)
    make_tiny_checkpoint(root / "tiny-b", "qwen2", smollm2)
    return root
