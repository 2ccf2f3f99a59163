"""The world a pull test runs in: a stand-in hub on loopback (HF_ENDPOINT), an empty
Hugging Face cache (HF_HOME in a temporary folder, no token), and the repos it serves: a GGUF
repo of two quantizations, one whose tensors modelhost cannot run, and a safetensors repo."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hub_standin import StandInHub
from synthetic_files import retype_tensor, write_tiny

from modelhost.models.loaded import LoadedModel

GGUF_REPO = "tester/Tiny-GGUF"
ODD_REPO = "tester/Odd-GGUF"  # an IQ4_XS tensor: a type modelhost does not run
HF_REPO = "tester/tiny-llama"
ALIEN_REPO = "tester/tiny-rwkv"  # an architecture no family covers
IQ4_XS = 23
GENERATION = json.dumps({"temperature": 0.6, "top_k": 20}).encode()  # the HF repo's defaults


@pytest.fixture(scope="session")
def hub_files(smollm2: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from tiny_models import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("hub-files")
    q4 = write_tiny(root / "tiny-Q4_K_M.gguf", "Q4_K_M")
    q8 = write_tiny(root / "tiny-Q8_0.gguf", "Q8_0")
    odd = write_tiny(root / "odd-IQ4_XS.gguf", "Q4_K_M")
    retype_tensor(odd, "blk.0.attn_q.weight", IQ4_XS)
    llama = make_tiny_checkpoint(root / "tiny-llama", "llama", smollm2)
    hf = {p.name: p for p in llama.iterdir() if p.is_file()}
    alien = dict(hf)
    config = json.loads((llama / "config.json").read_text())
    alien_config = root / "alien-config.json"
    alien_config.write_text(json.dumps({**config, "model_type": "rwkv7"}))
    alien["config.json"] = alien_config
    return {
        GGUF_REPO: {
            "Tiny-Q4_K_M.gguf": q4,
            "Tiny-Q8_0.gguf": q8,
            "README.md": b"# tiny\n",
        },
        ODD_REPO: {"Odd-IQ4_XS.gguf": odd},
        HF_REPO: {**hf, "README.md": b"# tiny llama\n", "generation_config.json": GENERATION},
        ALIEN_REPO: alien,
    }


@pytest.fixture
def hub(
    hub_files: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[StandInHub]:
    stand_in = StandInHub().start()
    for repo_id, files in hub_files.items():
        stand_in.add(repo_id, files)
    monkeypatch.setenv("HF_ENDPOINT", stand_in.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    yield stand_in
    stand_in.stop()


def hub_cache(tmp_path: Path) -> Path:
    return tmp_path / "hf" / "hub"
