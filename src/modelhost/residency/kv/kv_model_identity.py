"""Which blocks of the disk KV store (residency/kv/kv_store.py) a loaded model may use: those of
the same file (path, size, modification time), the same weights as held in memory (the
quantization mode decides them: the formats each linear holds) on the same device, and the same
KV layout (the engine describes it: block size, layers, heads, dtype)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING

from modelhost.residency.kv.kv_store import KVDiskStore

if TYPE_CHECKING:
    from modelhost.engine.kv.prefix_store import PrefixStore, PrefixStoreOpener
    from modelhost.models.loaded import LoadedModel


def files_identity(path: Path) -> str:
    """A file's resolved path, size and mtime; for a folder, each file's in it."""
    path = path.resolve()
    if path.is_dir():
        digest = hashlib.sha256()
        for item in sorted(path.iterdir()):
            if item.is_file():
                stat = item.stat()
                digest.update(f"{item.name}|{stat.st_size}|{stat.st_mtime_ns};".encode())
        return f"{path}|{digest.hexdigest()}"
    stat = path.stat()
    return f"{path}|{stat.st_size}|{stat.st_mtime_ns}"


def weights_identity(model: LoadedModel) -> str:
    """How the weights are held: the format of every linear, the dtype, the device."""
    from modelhost.models.loading.quant import describe

    formats = ",".join(f"{name}:{count}" for name, count in sorted(describe(model.network).items()))
    return f"{formats}|{model.dtype}|{model.device.type}"


def prefix_store_opener(model: LoadedModel, store: KVDiskStore) -> PrefixStoreOpener | None:
    """What the engine over `model` opens its prefix store with; None when the store is off."""
    if store.budget_bytes <= 0:
        return None
    model_identity = f"{files_identity(model.path)}|{weights_identity(model)}"

    def open_store(layout: str) -> PrefixStore:
        return store.for_model(model.id, f"{model_identity}|{layout}")

    return open_store
