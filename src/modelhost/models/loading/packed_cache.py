"""A GGUF's weights as the native kernels hold them, kept on disk to be mapped at the next load.

Repacking a quantized file into the kernels' tiles (kernels/native_repack.h) is most of a load:
~0.6 s for a 1B Q4_K_M file on two cores, ~1.6–2.5 s for a 3B, much of it the kernel handing
the process fresh pages. A model that comes back after a switch repacks the same bytes again.
So the first load writes what it repacked (`packed-<kernels build>-<mode>.bin` beside the file's
metadata in `MODELHOST_HOME/cache/gguf/<file>-<digest>/`, on a low-priority thread while the
model serves, which the process's end waits for), and later loads map that file instead:
read-only and populated, the page cache's own pages rather than fresh memory.

The cache is exact: the bytes are what the repack wrote, for this version of the file (its
folder's name has its path, size and modification time), this build of the kernels (a new build
may lay tiles out differently) and this quantization mode. A file whose header or size does not
match is ignored and removed; one is written beside and renamed into place, so a reader never
maps half of one. All packed files together stay under `MODELHOST_WEIGHTS_CACHE_GB` (default
16; 0 keeps none), least recently loaded removed first, and never leave the disk under 2 GB free.
"""

from __future__ import annotations

import contextlib
import functools
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
from modelhost.paths import gguf_cache_root

log = logging.getLogger(__name__)

MAGIC = b"MHPACK3\n"  # 3: weights keyed by their own names
# A file is renamed into place once written, and written back to the disk afterwards (a worker
# drained right after its first load must not wait seconds for that): its state says whether it
# is known to be on disk; one that is not is trusted only in the boot that wrote it.
WRITTEN, SYNCED = b"written\0", b"synced\0\0"
BOOT_BYTES = 40
PREFIX_BYTES = len(MAGIC) + 8 + BOOT_BYTES + 8  # magic, state, boot id, header length
ALIGN = 4096  # each array starts on a page: mapped arrays keep the kernels' 64-byte alignment
DEFAULT_BUDGET_GB = 16.0
WRITER_NICE = 19  # the writer yields the CPU to the model answering its first request
FREE_DISK_KEPT = 2 * 10**9  # bytes a packed file never takes from the disk


def budget_bytes() -> int:
    """`MODELHOST_WEIGHTS_CACHE_GB` in bytes (a value that is not a number: the default)."""
    try:
        gigabytes = float(os.environ.get("MODELHOST_WEIGHTS_CACHE_GB", DEFAULT_BUDGET_GB))
    except ValueError:
        gigabytes = DEFAULT_BUDGET_GB
    return max(0, int(gigabytes * 1e9))


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
        disk (the whole set: a load that missed one rewrites the file), which the process's
        end waits for; None when nothing is to be written."""
        if not self._kept:
            return None
        weights = {**self._kept, **self._found}
        # Not a daemon: a process ending (a worker drained right after its first load) waits
        # for it, or the next load of the file would repack it again, and so every load.
        thread = threading.Thread(target=self._save, args=(weights,), name="packed-weights-writer")
        thread.start()
        return thread

    def _save(self, weights: dict[str, PackedWeight]) -> None:
        _lower_this_thread()
        try:
            _write(self.path, weights)
        except OSError as exc:  # a full or read-only home costs the next load its repack only
            log.info("not keeping the packed weights of %s: %s", self.path.parent.name, exc)


def weight_key(names: list[str], format: int, outs: list[int], width: int) -> str:
    """What one packed weight was made from: its tensors (in order) under their own names
    (not the file's: a mixture of experts' experts share one stored tensor), their type, and
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
    start = _data_start(len(header))
    total = start + data_bytes
    if not _make_room(path, total):
        log.info("not keeping the packed weights of %s: over the weights cache budget",
                 path.parent.name)  # fmt: skip
        return
    boot = _boot_id()
    partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
    try:
        with open(partial, "wb") as out:
            out.write(_prefix(WRITTEN if boot else SYNCED, boot, len(header)) + header)
            for entry, weight in zip(entries, weights.values(), strict=True):
                for offset, array in zip(entry["offsets"], weight.tensors(), strict=True):
                    out.seek(start + offset)
                    out.write(array.numpy().data)
            out.truncate(total)
            if not boot:  # nothing tells a later load whether the machine restarted since
                out.flush()
                os.fsync(out.fileno())
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)
    log.info("kept the packed weights of %s (%.0f MB)", path.parent.name, total / 1e6)
    if boot:
        _sync_later(path)


def _sync_later(path: Path) -> None:
    """Writes `path` back to the disk, then marks it synced, on a low-priority daemon thread (a
    process that ends first leaves it to the next load of the file)."""

    def sync() -> None:
        _lower_this_thread()
        with contextlib.suppress(OSError), open(path, "r+b") as handle:
            os.fdatasync(handle.fileno())
            os.pwrite(handle.fileno(), SYNCED, len(MAGIC))
            os.fdatasync(handle.fileno())

    threading.Thread(target=sync, name="packed-weights-sync", daemon=True).start()


def _read(path: Path) -> dict[str, PackedWeight]:
    """The weights in `path`, mapped; {} when there is none, and when it cannot be trusted (it
    is removed then: it would never be right)."""
    try:
        handle = open(path, "rb")  # noqa: SIM115 (closed below, once mapped or refused)
    except OSError:  # none yet, or a home that is not a folder or cannot be read
        return {}
    try:
        with handle:
            start, header, mapped, synced = _mapped(handle)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring and removing %s: %s", path, exc)
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)
        return {}
    if not synced:
        _sync_later(path)
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


def _mapped(handle: BinaryIO) -> tuple[int, dict[str, Any], mmap.mmap, bool]:
    """A packed file's data offset, header, mapping and whether it is known to be on disk, once
    its header and size agree and it can be trusted: synced, or written since the machine
    started (the page cache holds what was written even if the disk does not yet)."""
    size = os.fstat(handle.fileno()).st_size
    prefix = handle.read(PREFIX_BYTES)
    if len(prefix) < PREFIX_BYTES or prefix[: len(MAGIC)] != MAGIC:
        raise ValueError("not a packed weights file")
    state = prefix[len(MAGIC) : len(MAGIC) + 8]
    boot = prefix[len(MAGIC) + 8 : len(MAGIC) + 8 + BOOT_BYTES].rstrip(b"\0").decode()
    if state != SYNCED and not (state == WRITTEN and boot and boot == _boot_id()):
        raise ValueError("written before the machine restarted, and maybe never on disk")
    length = int.from_bytes(prefix[-8:], "little")
    header = json.loads(handle.read(length))
    start = _data_start(length)
    if size != start + int(header["data_bytes"]):
        raise ValueError(f"{size} bytes, the header says {start + header['data_bytes']}")
    # Read-only: the page cache's own pages, none copied (a writable private mapping would copy
    # each one as it is populated); populated: the first prompt does not fault them one by one.
    flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_POPULATE", 0)
    mapped = mmap.mmap(handle.fileno(), size, flags=flags, prot=mmap.PROT_READ)
    return start, header, mapped, state == SYNCED


def _prefix(state: bytes, boot: str, header_bytes: int) -> bytes:
    return (
        MAGIC + state + boot.encode().ljust(BOOT_BYTES, b"\0") + header_bytes.to_bytes(8, "little")
    )


def _data_start(header_bytes: int) -> int:
    return -(-(PREFIX_BYTES + header_bytes) // ALIGN) * ALIGN


@functools.cache
def _boot_id() -> str:
    """This boot of the machine (Linux), or "" where unknown."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:BOOT_BYTES]
    except OSError:
        return ""


def _lower_this_thread() -> None:
    if sys.platform == "linux":  # a thread's own nice (see spare_process.py)
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)


def _make_room(path: Path, size: int) -> bool:
    """Removes the least recently loaded packed files (never `path`'s folder's own) until
    `size` more bytes fit the budget and leave the disk 2 GB free; False when they cannot."""
    budget = budget_bytes()
    if size > budget:
        return False
    others = sorted(
        (p for p in gguf_cache_root().glob("*/packed-*.bin") if p != path),
        key=lambda p: _stat_or_none(p) or 0.0,
    )
    held = sum(p.stat().st_size for p in others if p.exists())

    def fits() -> bool:
        free = shutil.disk_usage(path.parent).free
        return held + size <= budget and free - size >= FREE_DISK_KEPT

    for old in others:
        if fits():
            return True
        with contextlib.suppress(OSError):
            held -= old.stat().st_size
            old.unlink()
    return fits()


def _remove_abandoned(folder: Path) -> None:
    """Removes what a writer left half-written when its process ended (a worker killed mid-way
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
