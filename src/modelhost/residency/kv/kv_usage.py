"""What the disk KV store holds, by model, and the running tally of it kept beside the blocks
(MODELHOST_HOME/kv/.usage.json), so that `/stats`, `modelhost ls` and `modelhost cache ls` read the
store's size without listing its files:

    {"version": 1, "scanned_at": <unix time of the last walk over every file>,
     "models": {"<model directory>": {"id": "<model id>", "files": N, "bytes": B}}}

The store (kv_store.py) changes its files only under its `fcntl` lock and updates the tally
under the same lock (a block written or replaced, a bad block removed, a sweep, a clear), so
every process sharing a home — a server's front and its workers, or two servers — reads one
figure. It can still drift: a process killed between moving a block into place and counting
it, or files removed by hand. Every walk over the files (the least-recently-used sweep, a
clear) rewrites it from what it found, and a tally not rewritten so for RESCAN_S is rebuilt by
a walk the next time someone reads it. Pure Python.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

TALLY_FILE = ".usage.json"
TALLY_VERSION = 1
RESCAN_S = 60.0  # the longest a drifted tally is believed; a walk costs a stat a block


@dataclass(frozen=True, slots=True)
class ModelUsage:
    id: str
    directory: str
    files: int
    bytes: int


@dataclass(frozen=True, slots=True)
class StoreUsage:
    path: str
    budget_bytes: int
    files: int
    bytes: int
    models: tuple[ModelUsage, ...]

    def as_json(self) -> dict[str, object]:
        return {
            "path": self.path,
            "budget_bytes": self.budget_bytes,
            "files": self.files,
            "bytes": self.bytes,
            "models": [{"id": m.id, "files": m.files, "bytes": m.bytes} for m in self.models],
        }


@dataclass(slots=True)
class Tally:
    """Blocks and bytes by model directory, as of the last walk plus every change since."""

    scanned_at: float
    models: dict[str, ModelUsage] = field(default_factory=dict)

    @property
    def bytes(self) -> int:
        return sum(m.bytes for m in self.models.values())

    def count(self, directory: str, model_id: str, files: int, num_bytes: int) -> None:
        """Add `files` blocks of `num_bytes` (negative: removed) to `directory`'s figures."""
        was = self.models.get(directory) or ModelUsage(model_id, directory, 0, 0)
        self.models[directory] = ModelUsage(
            was.id, directory, max(0, was.files + files), max(0, was.bytes + num_bytes)
        )

    def usage(self, root: Path, budget_bytes: int) -> StoreUsage:
        models = tuple(self.models[name] for name in sorted(self.models))
        return StoreUsage(
            path=str(root),
            budget_bytes=budget_bytes,
            files=sum(m.files for m in models),
            bytes=sum(m.bytes for m in models),
            models=models,
        )


def read_tally(root: Path) -> Tally | None:
    """The tally under `root`; None when there is none, or it is unreadable (torn by a write
    this reader did not wait for, or broken) or another version's."""
    try:
        raw = json.loads((root / TALLY_FILE).read_text())
        if raw.get("version") != TALLY_VERSION:
            return None
        models = {
            str(name): ModelUsage(str(m["id"]), str(name), int(m["files"]), int(m["bytes"]))
            for name, m in raw["models"].items()
        }
        return Tally(float(raw["scanned_at"]), models)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def write_tally(root: Path, tally: Tally) -> None:
    """Write the tally in place (the caller holds the store's lock). Never truncated: a shorter
    text is padded with spaces (JSON allows them), because ext4 flushes a file to disk when it
    is truncated and written again, or renamed over another, and every block write updates it.
    A reader without the lock may so see a torn text: it then reads again under the lock."""
    models = {
        name: {"id": m.id, "files": m.files, "bytes": m.bytes} for name, m in tally.models.items()
    }
    body = {"version": TALLY_VERSION, "scanned_at": tally.scanned_at, "models": models}
    data = json.dumps(body).encode()
    fd = os.open(root / TALLY_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        os.pwrite(fd, data.ljust(size, b" "), 0)
    finally:
        os.close(fd)
