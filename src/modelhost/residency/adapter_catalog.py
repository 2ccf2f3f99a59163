"""The LoRA adapters a server offers, by name: each one's base model and its files.

Kept by the front (pure Python, no PyTorch): the router routes a request naming an adapter to
its base, the listings show each adapter with its base, and the unit that serves a base is
told its adapters when it starts (a worker in its `--config`, an in-process stage when it is
built), so a base that was let go and comes back serves them again. The weights themselves are
the base's unit's (models/adapters/adapter_set.py).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


@dataclass(frozen=True, slots=True)
class AdapterEntry:
    name: str
    base: str  # the model id whose unit serves it
    path: str  # a PEFT folder or a llama.cpp GGUF LoRA file


def parse_adapter_argument(value: str) -> tuple[str, str]:
    """`--adapter NAME=PATH` as (name, absolute path); ValueError saying what is wrong."""
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--adapter takes NAME=PATH, not '{value}'")
    return name, str(adapter_path(path))


def adapter_path(path: str) -> Path:
    """`path` resolved, when it holds an adapter's files; ValueError otherwise."""
    resolved = Path(path).expanduser().resolve()
    if resolved.is_dir():
        missing = [name for name in ADAPTER_FILES if not (resolved / name).is_file()]
        if missing:
            raise ValueError(f"adapter folder {resolved} lacks {', '.join(missing)}")
        return resolved
    if resolved.is_file() and resolved.suffix == ".gguf":
        return resolved
    raise ValueError(
        f"no LoRA adapter at {resolved}: a PEFT folder ({' + '.join(ADAPTER_FILES)}) or a "
        "llama.cpp GGUF LoRA file"
    )


class AdapterCatalog:
    def __init__(self, entries: tuple[tuple[str, str, str], ...] = ()) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, AdapterEntry] = {}
        for name, base, path in entries:
            self._entries[name] = AdapterEntry(name, base, path)

    def get(self, name: str | None) -> AdapterEntry | None:
        if name is None:
            return None
        with self._lock:
            return self._entries.get(name)

    def entries(self) -> list[AdapterEntry]:
        with self._lock:
            return list(self._entries.values())

    def for_base(self, base: str) -> tuple[tuple[str, str, str], ...]:
        """The (name, base, path) of `base`'s adapters: what its unit is told at its start."""
        return tuple((e.name, e.base, e.path) for e in self.entries() if e.base == base)

    def add(self, entry: AdapterEntry) -> None:
        with self._lock:
            self._entries[entry.name] = entry

    def remove(self, name: str) -> AdapterEntry | None:
        with self._lock:
            return self._entries.pop(name, None)
