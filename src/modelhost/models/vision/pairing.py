"""Which mmproj file goes with a text GGUF, read without PyTorch (the registry and the model
listing ask it). llama-server pairs them with `--mmproj`; LM Studio and the Hugging Face repos
of llama.cpp's conversions put `mmproj-<name>.gguf` in the model's folder, and so do we: the
first `mmproj*.gguf` beside a model (by name) is its vision projector, unless one is named."""

from __future__ import annotations

from pathlib import Path

from modelhost.models.loading.gguf_header import GGUFFile

# llama.cpp's `clip.projector_type`s whose towers models/vision/ builds and serves.
MMPROJ_PROJECTORS = ("idefics3", "qwen2.5vl_merger", "gemma3")


def is_mmproj(path: Path) -> bool:
    """Whether a .gguf is a vision projector (never a model of its own)."""
    return path.suffix == ".gguf" and path.name.lower().startswith("mmproj")


def mmproj_beside(model: Path) -> Path | None:
    """The mmproj file in a text GGUF's folder, if any."""
    if model.suffix != ".gguf" or is_mmproj(model):
        return None
    found = sorted(p for p in model.parent.glob("*.gguf") if is_mmproj(p))
    return found[0] if found else None


def projector_type(path: Path) -> str | None:
    header = GGUFFile(path)
    kind = header.field("clip.projector_type") or header.field("clip.vision.projector_type")
    return kind if isinstance(kind, str) else None


def reads_images(model: Path) -> bool:
    """Whether a text GGUF has an mmproj beside it whose projector we compute."""
    mmproj = mmproj_beside(model)
    if mmproj is None:
        return False
    try:
        return projector_type(mmproj) in MMPROJ_PROJECTORS
    except (OSError, ValueError, KeyError):
        return False
