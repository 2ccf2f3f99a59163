"""The disk the caches take, by model, and removing them (`modelhost cache`, `modelhost ls`,
`/stats.disk_caches`, the console's Models view).

Two caches grow with the models a home has served:

- the packed copy of a GGUF's weights, `MODELHOST_HOME/cache/gguf/<file>-<digest>/packed-*.bin`
  (models/loading/packed_cache.py): the weights as the kernels hold them, one file a version of
  the GGUF, kernels build and mode, about the size of the weights (a 1B Q4_K_M: 1.09 GB beside
  the 0.67 GB file). Its folder is named for the file's path, size and modification time
  (paths.file_cache_key), so a model is matched to its copy through its file; a folder no
  listed model's file names (the file was replaced or moved, or is not among the paths given)
  is listed under its own name.
- the model's blocks in the prefix KV store, `MODELHOST_HOME/kv` (residency/kv/kv_store.py),
  read from its running tally.

A packed file that a live process maps (a resident model's worker, on Linux: /proc/PID/maps)
is kept by `clear_packed`: removing it would give back no disk until that process ends, and
would cost the model's next load its repack. Pure Python, no PyTorch.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from modelhost.paths import file_cache_key, gguf_cache_root
from modelhost.residency.kv.kv_store import KVDiskStore
from modelhost.residency.kv.kv_usage import StoreUsage

if TYPE_CHECKING:
    from modelhost.residency.registry import ModelEntry

PACKED_NAMES = "packed-*.bin"  # a packed copy, in its GGUF file's cache folder


@dataclass(frozen=True, slots=True)
class PackedFile:
    path: Path
    bytes: int

    @property
    def folder(self) -> str:
        """The file version's folder (`<file stem>-<digest>`)."""
        return self.path.parent.name


@dataclass(slots=True)
class ModelCaches:
    """What one model (or one unmatched packed folder) holds on disk."""

    id: str
    packed_bytes: int = 0
    packed_files: list[PackedFile] = field(default_factory=list)
    kv_bytes: int = 0
    kv_blocks: int = 0
    listed: bool = True  # a model among those listed, not a folder known by its name only

    def as_json(self) -> dict[str, object]:
        return {
            "id": self.id,
            "packed_bytes": self.packed_bytes,
            "kv_bytes": self.kv_bytes,
            "kv_blocks": self.kv_blocks,
            "listed": self.listed,
        }


def packed_files(root: Path | None = None) -> list[PackedFile]:
    """Every packed weights file under the cache (`root`: gguf_cache_root()). A folder can go
    while it is listed (a loading worker renames its `.partial-PID` folder into place), so each
    folder is read on its own and one that went is passed over."""
    found: list[PackedFile] = []
    try:
        folders = sorted(entry for entry in (root or gguf_cache_root()).iterdir())
    except OSError:  # no cache yet
        return found
    for folder in folders:
        with contextlib.suppress(OSError):  # removed while listed
            for path in sorted(folder.glob(PACKED_NAMES)):
                found.append(PackedFile(path, path.stat().st_size))
    return found


def cache_folder_of(path: Path) -> str | None:
    """The cache folder's name of a GGUF file; None when the file cannot be read."""
    try:
        return file_cache_key(path)
    except OSError:
        return None


def by_model(
    models: Iterable[tuple[str, Path | None]], packed: list[PackedFile], kv: StoreUsage
) -> list[ModelCaches]:
    """Each model's caches, given (id, GGUF file or None) pairs: every listed model in order,
    then the packed folders and KV store models no listed model matched."""
    rows: dict[str, ModelCaches] = {}
    folders: dict[str, str] = {}
    for model_id, path in models:
        rows[model_id] = ModelCaches(model_id)
        folder = cache_folder_of(path) if path is not None else None
        if folder is not None:
            folders[folder] = model_id
    for file in packed:
        model_id = folders.get(file.folder, file.folder)
        row = rows.setdefault(model_id, ModelCaches(model_id, listed=False))
        row.packed_bytes += file.bytes
        row.packed_files.append(file)
    for usage in kv.models:  # one model may hold blocks under several identities
        row = rows.setdefault(usage.id, ModelCaches(usage.id, listed=False))
        row.kv_bytes += usage.bytes
        row.kv_blocks += usage.files
    return list(rows.values())


def model_caches(entries: Iterable[ModelEntry]) -> list[ModelCaches]:
    """`by_model` for registry entries, read from this home's caches now."""
    models = [(e.id, e.path if e.format == "gguf" else None) for e in entries]
    return by_model(models, packed_files(), KVDiskStore().usage())


def mapping_processes(paths: Iterable[Path]) -> dict[Path, list[int]]:
    """The live processes (ids) that map each of `paths`, of those this user may inspect;
    {} where /proc is not there to ask."""
    wanted = {str(path.resolve()): path for path in paths}
    found: dict[Path, list[int]] = {}
    if not wanted or not Path("/proc/self/maps").exists():
        return found
    root = os.path.commonpath(list(wanted))
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/maps") as maps:
                text = maps.read()
        except OSError:  # ended meanwhile, or another user's
            continue
        if root not in text:
            continue
        for name, path in wanted.items():
            if name in text:
                found.setdefault(path, []).append(int(entry.name))
    return found


@dataclass(frozen=True, slots=True)
class PackedClearing:
    removed: list[PackedFile]
    kept: dict[Path, list[int]]  # mapped by live processes: their ids

    @property
    def removed_bytes(self) -> int:
        return sum(file.bytes for file in self.removed)


def clear_packed(files: list[PackedFile]) -> PackedClearing:
    """Remove `files`, keeping those a live process maps."""
    kept = mapping_processes(file.path for file in files)
    removed = []
    for file in files:
        if file.path in kept:
            continue
        with contextlib.suppress(FileNotFoundError):
            file.path.unlink()
            removed.append(file)
    return PackedClearing(removed, kept)
