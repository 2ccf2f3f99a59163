"""A GGUF's weights as the native kernels hold them, kept on disk to be mapped at the next load.

Repacking a quantized file into the kernels' tiles (kernels/native_repack.h) is most of a load:
~0.6 s for a 1B Q4_K_M file on two cores, ~1.6–2.5 s for a 3B, much of it the kernel handing
the process fresh pages. A model that comes back after a switch repacks the same bytes again.
So the first load writes what it repacked (`packed-<kernels build>-<mode>.bin` beside the file's
metadata in `MODELHOST_HOME/cache/gguf/<file>-<digest>/`, on a low-priority thread once the model
serves), and later loads map that file instead: private, populated, read-only in practice, at
about the file's size in page cache rather than fresh memory.

The cache is exact: the bytes are what the repack wrote, for this version of the file (its
folder's name has its path, size and modification time), this build of the kernels (a new build
may lay tiles out differently) and this quantization mode. A file whose header or size does not
match is ignored and removed; one is written beside and renamed into place, so a reader never
maps half of one. All packed files together stay under `MODELHOST_WEIGHTS_CACHE_GB` (default
16; 0 keeps none), least recently loaded removed first, and never take the disk's last 10%.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import shutil
import sys
import threading
import warnings
from pathlib import Path
from typing import Any, BinaryIO

import torch

from modelhost.models.kernels.packed import PackedWeight
from modelhost.paths import modelhost_home

log = logging.getLogger(__name__)

MAGIC = b"MHPACK1\n"
ALIGN = 4096  # each array starts on a page: mapped arrays keep the kernels' 64-byte alignment
DEFAULT_BUDGET_GB = 16.0
WRITER_NICE = 19  # the writer yields the CPU to the model answering its first request
FREE_DISK_KEPT = 0.10
# Written back this often by the writer itself, at its low priority: left to the kernel's
# flusher threads, the writeback of a few GB (seconds of CPU on a small VM) would run at the
# usual priority beside the model answering.
SYNC_BYTES = 64 << 20


def budget_bytes() -> int:
    """`MODELHOST_WEIGHTS_CACHE_GB` in bytes (a value that is not a number: the default)."""
    try:
        gigabytes = float(os.environ.get("MODELHOST_WEIGHTS_CACHE_GB", DEFAULT_BUDGET_GB))
    except ValueError:
        gigabytes = DEFAULT_BUDGET_GB
    return max(0, int(gigabytes * 1e9))


def cache_root() -> Path:
    return modelhost_home() / "cache" / "gguf"


class PackedCache:
    """The packed weights of one file for one kernels build and mode: those found on disk
    (`get`), and those repacked by this load (`keep`) for `save_later` to write."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._found: dict[str, PackedWeight] = {}
        self._kept: dict[str, PackedWeight] = {}

    @classmethod
    def open(cls, folder: Path, build: str, mode: str) -> PackedCache | None:
        """The cache for a file whose metadata lives in `folder`, with what is already on disk
        mapped; None when the budget keeps none."""
        if budget_bytes() == 0:
            return None
        cache = cls(folder / f"packed-{build}-{mode}.bin")
        _remove_abandoned(folder)
        cache._found = _read(cache.path)
        if cache._found:
            with contextlib.suppress(OSError):
                os.utime(cache.path)  # loaded now: the last to be removed for room
        return cache

    def get(self, key: str) -> PackedWeight | None:
        return self._found.get(key)

    def keep(self, key: str, weight: PackedWeight) -> None:
        self._kept[key] = weight

    def save_later(self) -> threading.Thread | None:
        """Writes this load's repacked weights on a low-priority thread when any was not on
        disk (the whole set: a load that missed one rewrites the file); None when nothing is
        to be written."""
        if not self._kept:
            return None
        weights = {**self._kept, **self._found}
        thread = threading.Thread(
            target=self._save, args=(weights,), name="packed-weights-writer", daemon=True
        )
        thread.start()
        return thread

    def _save(self, weights: dict[str, PackedWeight]) -> None:
        if sys.platform == "linux":  # a thread's own nice (see spare_process.py)
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
        try:
            _write(self.path, weights)
        except OSError as exc:  # a full or read-only home costs the next load its repack only
            log.info("not keeping the packed weights of %s: %s", self.path.parent.name, exc)


def weight_key(names: list[str], format: int, outs: list[int], width: int) -> str:
    """What one packed weight was made from: the file's tensors (in order), their type, and
    the shape it was packed to."""
    return f"{'+'.join(names)}:{format}:{'+'.join(map(str, outs))}x{width}"


def _layout(weights: dict[str, PackedWeight]) -> tuple[list[dict[str, Any]], int]:
    entries, offset = [], 0
    for key, weight in weights.items():
        offsets, sizes = [], []
        for array in weight.tensors():
            offsets.append(offset)
            sizes.append(array.numel())
            offset += -(-array.numel() // ALIGN) * ALIGN
        row = {"key": key, "format": weight.format, "out": weight.out, "width": weight.width}
        entries.append({**row, "offsets": offsets, "sizes": sizes})
    return entries, offset


def _write(path: Path, weights: dict[str, PackedWeight]) -> None:
    entries, data_bytes = _layout(weights)
    header = json.dumps({"weights": entries, "data_bytes": data_bytes}).encode()
    start = -(-(len(MAGIC) + 8 + len(header)) // ALIGN) * ALIGN
    total = start + data_bytes
    if not _make_room(path, total):
        log.info("not keeping the packed weights of %s: over the weights cache budget",
                 path.parent.name)  # fmt: skip
        return
    partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
    try:
        with open(partial, "wb") as out:
            out.write(MAGIC + len(header).to_bytes(8, "little") + header)
            unsynced = 0
            for entry, weight in zip(entries, weights.values(), strict=True):
                for offset, array in zip(entry["offsets"], weight.tensors(), strict=True):
                    out.seek(start + offset)
                    out.write(array.numpy().data)
                    unsynced += array.numel()
                    if unsynced >= SYNC_BYTES:
                        out.flush()
                        os.fdatasync(out.fileno())
                        unsynced = 0
            out.truncate(total)
            out.flush()
            os.fsync(out.fileno())  # renamed only once on disk: a crash leaves no torn file
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)
    log.info("kept the packed weights of %s (%.0f MB)", path.parent.name, total / 1e6)


def _read(path: Path) -> dict[str, PackedWeight]:
    """The weights in `path`, mapped; {} when there is none, and when it is not whole (it is
    removed then: it would never be right)."""
    try:
        with open(path, "rb") as handle:
            start, header, mapped = _mapped(handle)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring and removing %s: %s", path, exc)
        path.unlink(missing_ok=True)
        return {}
    with warnings.catch_warnings():  # the kernels only read weights: read-only is right
        warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
        whole = torch.frombuffer(mapped, dtype=torch.uint8)
    found = {}
    for entry in header["weights"]:
        arrays = tuple(
            whole[start + offset : start + offset + size]
            for offset, size in zip(entry["offsets"], entry["sizes"], strict=True)
        )
        found[entry["key"]] = PackedWeight(entry["format"], entry["out"], entry["width"], arrays)
    return found


def _mapped(handle: BinaryIO) -> tuple[int, dict[str, Any], mmap.mmap]:
    """A packed file's data offset, header and mapping, once its header and size agree."""
    size = os.fstat(handle.fileno()).st_size
    head = handle.read(len(MAGIC) + 8)
    if head[: len(MAGIC)] != MAGIC:
        raise ValueError("not a packed weights file")
    length = int.from_bytes(head[len(MAGIC) :], "little")
    header = json.loads(handle.read(length))
    start = -(-(len(MAGIC) + 8 + length) // ALIGN) * ALIGN
    if size != start + int(header["data_bytes"]):
        raise ValueError(f"{size} bytes, the header says {start + header['data_bytes']}")
    # Read-only: the page cache's own pages, none copied (a writable private mapping would copy
    # each one as it is populated); populated: the first prompt does not fault them one by one.
    flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_POPULATE", 0)
    return start, header, mmap.mmap(handle.fileno(), size, flags=flags, prot=mmap.PROT_READ)


def _make_room(path: Path, size: int) -> bool:
    """Removes the least recently loaded packed files (never `path`'s folder's own) until
    `size` more bytes fit the budget and leave the disk its last 10%; False when they cannot."""
    budget = budget_bytes()
    if size > budget:
        return False
    others = sorted(
        (p for p in cache_root().glob("*/packed-*.bin") if p != path),
        key=lambda p: _stat_or_none(p) or 0.0,
    )
    held = sum(p.stat().st_size for p in others if p.exists())
    for old in others:
        usage = shutil.disk_usage(path.parent)
        if held + size <= budget and usage.free - size >= FREE_DISK_KEPT * usage.total:
            return True
        with contextlib.suppress(OSError):
            held -= old.stat().st_size
            old.unlink()
    usage = shutil.disk_usage(path.parent)
    return held + size <= budget and usage.free - size >= FREE_DISK_KEPT * usage.total


def _remove_abandoned(folder: Path) -> None:
    """Removes what a writer left half-written when its process ended (a worker drained mid-way
    ends without waiting for it)."""
    for partial in folder.glob("packed-*.partial-*"):
        try:
            os.kill(int(partial.name.rpartition("-")[2]), 0)
        except ProcessLookupError:
            partial.unlink(missing_ok=True)
        except (ValueError, OSError):
            continue


def _stat_or_none(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None
