"""Where modelhost keeps its files."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def modelhost_home() -> Path:
    """`MODELHOST_HOME`, default ~/.modelhost: db/, jobs/, models/, cache/."""
    return Path(os.environ.get("MODELHOST_HOME") or Path.home() / ".modelhost")


def gguf_cache_root() -> Path:
    """Where each GGUF file's metadata, converted tokenizer and packed weights are kept, a
    folder a file version (`file_cache_key`)."""
    return modelhost_home() / "cache" / "gguf"


def file_cache_key(path: Path) -> str:
    """A name for this version of a file in a cache: its stem and a digest of its resolved
    path, size and modification time (a file replaced in place gets a new name)."""
    stat = path.stat()
    digest = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    return f"{path.stem}-{digest.hexdigest()[:12]}"
