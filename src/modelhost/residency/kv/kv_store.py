"""The prefix KV store on disk: full KV blocks that outlive the worker which computed them.

    MODELHOST_HOME/kv/
        .lock                                    the lock every change of its files takes
        .usage.json                              its running tally: blocks and bytes by model
        <model>-<identity digest>/model.json     {"id", "identity"}: whose blocks these are
        <model>-<identity digest>/<ab>/<key>.kvb one block (kv_block_file.py), named by its key

A model's identity is its file (path, size, modification time), how its weights are held and
its KV layout (residency/kv/kv_model_identity.py): a file replaced in place, another quantization
or another KV dtype gets a directory of its own. The engine reads and writes through
`ModelKVStore` (engine/kv/prefix_store.py's PrefixStore); the front lists and clears the store.

Several processes may share a home: a block is written to a temporary name and moved into place
(`os.replace`: a reader sees the whole file or none), a file is checked whenever it is read, and
files are moved in or removed only under an `fcntl` lock: the sweep that holds the store to its
byte budget (least recently used out: a read touches a file's mtime), a clear, and the update
of the store's running tally (kv_usage.py) that every write makes, so that what the store holds
is read without listing its files. Pure Python, no torch.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from modelhost.paths import modelhost_home
from modelhost.residency.kv import kv_block_file
from modelhost.residency.kv.kv_usage import (
    RESCAN_S,
    StoreUsage,
    Tally,
    read_tally,
    write_tally,
)

log = logging.getLogger(__name__)

GB = 1_000_000_000
DEFAULT_BUDGET_BYTES = 8 * GB
DISK_SHARE = 0.10  # the default budget never takes more than this share of the free disk
LOW_WATER = 0.9  # a sweep leaves the store at this share of its budget
SWEEP_EVERY = 0.05  # ... and runs again once this share of the budget has been written since
STALE_TEMP_S = 3600.0  # a temporary file this old was left by a process that died writing it
SUFFIX = ".kvb"
MODEL_FILE = "model.json"


def kv_root() -> Path:
    return modelhost_home() / "kv"


def default_budget_bytes(root: Path | None = None) -> int:
    """8 GB, but never more than a tenth of the disk space free where the store lives."""
    place = root or kv_root()
    while not place.exists() and place != place.parent:
        place = place.parent
    try:
        free = shutil.disk_usage(place).free
    except OSError:
        return 0
    return min(DEFAULT_BUDGET_BYTES, int(free * DISK_SHARE))


class KVDiskStore:
    """Every model's blocks under `root`, held to `budget_bytes` (0: nothing is written)."""

    def __init__(self, root: Path | None = None, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        self.root = root or kv_root()
        self.budget_bytes = max(0, int(budget_bytes))
        self._lock = threading.Lock()
        self._written_since_sweep = 0

    # ---- a model's view --------------------------------------------------------------------

    def for_model(self, model_id: str, identity: str) -> ModelKVStore:
        digest = hashlib.blake2b(identity.encode(), digest_size=kv_block_file.KEY_BYTES).digest()
        slug = re.sub(r"[^A-Za-z0-9._-]+", "_", model_id)[:64].strip("._") or "model"
        directory = self.root / f"{slug}-{digest.hex()[:16]}"
        return ModelKVStore(self, directory, model_id, identity, digest)

    # ---- budget ----------------------------------------------------------------------------

    def note_written(self, num_bytes: int, total_bytes: int) -> None:
        """Count a write (`total_bytes`: the store's tally after it); sweep when the store has
        outgrown its budget, or once SWEEP_EVERY of it was written here since the last sweep
        (which also sets right a tally that drifted)."""
        with self._lock:
            self._written_since_sweep += num_bytes
            due = self._written_since_sweep > self.budget_bytes * SWEEP_EVERY
        if due or total_bytes > self.budget_bytes:
            self.sweep()

    def sweep(self) -> int:
        """Remove the least recently used blocks until the store is within its budget (to
        LOW_WATER of it when it was over), and temporary files left by dead writers; the
        tally is rewritten from what the walk found. Returns the bytes removed."""
        removed = 0
        with self._locked():
            files, tally = self._walk()
            total = tally.bytes
            if total > self.budget_bytes:
                files.sort()
                target = int(self.budget_bytes * LOW_WATER)
                for _, size, path in files:
                    if total <= target:
                        break
                    if _unlink(path):
                        total -= size
                        removed += size
                        tally.count(path.parent.parent.name, "", -1, -size)
            self._write_tally(tally)
        with self._lock:
            self._written_since_sweep = 0
        if removed:
            log.info("KV store: %.1f MB of least recently used blocks removed", removed / 1e6)
        return removed

    # ---- views and control -----------------------------------------------------------------

    def usage(self) -> StoreUsage:
        """What the store holds, by model: its tally (kv_usage.py), read without listing a
        file; rebuilt by a walk when missing or not rewritten by one for RESCAN_S (what
        another process changed without counting it shows within that)."""
        tally = read_tally(self.root)
        if tally is None and self.root.is_dir():  # perhaps torn by a writer: read it whole
            with contextlib.suppress(OSError), self._locked():
                tally = read_tally(self.root)
        if tally is None or not 0 <= time.time() - tally.scanned_at <= RESCAN_S:
            tally = self.rescan()
        return tally.usage(self.root, self.budget_bytes)

    def rescan(self) -> Tally:
        """Walk every file and rewrite the tally (without the lock and without writing where
        the home is read-only, or the store was never made)."""
        if not self.root.is_dir():
            return Tally(time.time())
        try:
            with self._locked():
                tally = self._walk()[1]
                self._write_tally(tally)
                return tally
        except OSError:
            return self._walk(remove_stale=False)[1]

    def clear(self, model_id: str | None = None) -> StoreUsage:
        """Remove every model's blocks, or `model_id`'s only; returns what was removed."""
        with self._locked():
            tally = self._walk()[1]
            gone = [m for m in tally.models.values() if model_id is None or m.id == model_id]
            for model in gone:
                shutil.rmtree(self.root / model.directory, ignore_errors=True)
                del tally.models[model.directory]
            self._write_tally(tally)
        return Tally(tally.scanned_at, {m.directory: m for m in gone}).usage(
            self.root, self.budget_bytes
        )

    # ---- files -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _walk(self, remove_stale: bool = True) -> tuple[list[tuple[float, int, Path]], Tally]:
        """Every block file (mtime, size, path) and the tally they make; temporary files left
        by dead writers are removed on the way."""
        now = time.time()
        files = []
        tally = Tally(now)
        for directory in self._model_dirs():
            tally.count(directory.name, _model_id(directory), 0, 0)
            for path, stat in _files_under(directory):
                if path.suffix != SUFFIX:
                    if remove_stale and now - stat.st_mtime > STALE_TEMP_S:
                        _unlink(path)
                    continue
                files.append((stat.st_mtime, stat.st_size, path))
                tally.count(directory.name, "", 1, stat.st_size)
        return files, tally

    def _write_tally(self, tally: Tally) -> None:
        try:
            write_tally(self.root, tally)
        except OSError as exc:
            log.warning("KV store: cannot write its tally in %s: %s", self.root, exc)

    def _counted(self, directory: str, model_id: str, files: int, num_bytes: int) -> int:
        """Add a change to the tally (the caller holds the lock); returns the store's bytes.
        Without a tally (a new store, or one written by an older version) a walk makes one,
        and that walk has already seen the change."""
        tally = read_tally(self.root)
        if tally is None:
            tally = self._walk()[1]
        else:
            tally.count(directory, model_id, files, num_bytes)
        self._write_tally(tally)
        return tally.bytes

    def _model_dirs(self) -> list[Path]:
        try:
            return sorted(p for p in self.root.iterdir() if p.is_dir())
        except OSError:
            return []


class ModelKVStore:
    """One model's (one KV layout's) blocks: the engine's PrefixStore."""

    def __init__(
        self, store: KVDiskStore, directory: Path, model_id: str, identity: str, digest: bytes
    ) -> None:
        self.store = store
        self.directory = directory
        self.model_id = model_id
        self.identity = identity
        self._digest = digest

    def _path(self, key: bytes) -> Path:
        name = key.hex()
        return self.directory / name[:2] / f"{name}{SUFFIX}"

    def has(self, key: bytes) -> bool:
        return self._path(key).is_file()

    def get(
        self, key: bytes, parent: bytes | None, tokens: Sequence[int], num_bytes: int
    ) -> memoryview | None:
        path = self._path(key)
        try:
            with open(path, "rb") as file:
                size = os.fstat(file.fileno()).st_size
                if size != kv_block_file.file_bytes(len(tokens), num_bytes):
                    data = None
                else:
                    data = bytearray(size)
                    if file.readinto(data) != size:
                        data = None
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("KV store: cannot read %s: %s", path, exc)
            return None
        payload = None
        if data is not None:
            payload = kv_block_file.decode(data, self._digest, key, parent, tokens, num_bytes)
        if payload is None:  # torn, foreign or corrupt: never served, and not kept
            log.warning("KV store: %s is not the block it is named for; removed", path)
            self._remove(path)
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # recently used: evicted last
        return payload

    def put(self, key: bytes, parent: bytes | None, tokens: Sequence[int], payload: bytes) -> None:
        if self.store.budget_bytes <= 0:
            return
        header, token_bytes = kv_block_file.encode(self._digest, key, parent, tokens, payload)
        path = self._path(key)
        temp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        if not path.parent.is_dir():  # a new fan-out folder, or the store was cleared
            self._make_directory(path.parent)
        size = len(header) + len(token_bytes) + len(payload)
        try:
            with open(temp, "wb") as file:
                file.write(header)
                file.write(token_bytes)
                file.write(payload)
            # Moved into place and counted under the lock: a sweep or a clear in another
            # process sees the file and the tally agree.
            with self.store._locked():
                replaced = _size_of(path)
                os.replace(temp, path)
                total = self.store._counted(
                    self.directory.name,
                    self.model_id,
                    int(replaced is None),
                    size - (replaced or 0),
                )
        except OSError as exc:
            log.warning("KV store: cannot write %s: %s", path, exc)
            _unlink(temp)
            return
        self.store.note_written(size, total)

    def _remove(self, path: Path) -> None:
        """Remove a block file and take it off the tally."""
        with contextlib.suppress(OSError), self.store._locked():
            size = _size_of(path)
            if size is not None and _unlink(path):
                self.store._counted(self.directory.name, self.model_id, -1, -size)

    def _make_directory(self, directory: Path) -> None:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            marker = self.directory / MODEL_FILE
            if not marker.exists():
                temp = marker.with_name(f".{MODEL_FILE}.{os.getpid()}.tmp")
                temp.write_text(json.dumps({"id": self.model_id, "identity": self.identity}))
                os.replace(temp, marker)
        except OSError as exc:
            log.warning("KV store: cannot make %s: %s", directory, exc)


def _model_id(directory: Path) -> str:
    try:
        return str(json.loads((directory / MODEL_FILE).read_text())["id"])
    except (OSError, ValueError, KeyError, TypeError):
        return directory.name


def _files_under(directory: Path) -> Iterator[tuple[Path, os.stat_result]]:
    """The block files (and temporary files) in a model's fan-out folders."""
    try:
        fans = [entry for entry in os.scandir(directory) if entry.is_dir()]
    except OSError:
        return
    for fan in fans:
        try:
            entries = list(os.scandir(fan.path))
        except OSError:
            continue
        for entry in entries:
            with contextlib.suppress(OSError):
                if entry.is_file():
                    yield Path(entry.path), entry.stat()


def _size_of(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


def _unlink(path: Path) -> bool:
    try:
        path.unlink()
    except OSError:
        return False
    return True
