"""Tiny synthetic GGUF files (benchmarks/synthetic_gguf.py): Llama-shaped, random weights,
SmolLM2's real tokenizer, in any GGUF type."""

from __future__ import annotations

import importlib
import struct
import sys
from pathlib import Path

sys.path.append(
    str(Path(__file__).resolve().parents[1] / "benchmarks")
)  # after src: its engine.py etc. must not shadow
synthetic_gguf = importlib.import_module("synthetic_gguf")

TYPES = list(synthetic_gguf.MIXTURES)  # Q4_K_M, Q5_K_M, Q6_K, ... F32


def write_tiny(path: Path, qtype: str, *, layers: int = 2) -> Path:
    """A tiny-shape file (width 256, 2 layers, SmolLM2's vocabulary) of `qtype`."""
    return synthetic_gguf.write_synthetic_gguf(path, "tiny", qtype, layers=layers)


def retype_tensor(path: Path, name: str, new_type: int) -> None:
    """Rewrites one tensor's GGUF type id in the file's tensor table, in place (for a type of
    the same block size: the data stays as it is)."""
    data = bytearray(path.read_bytes())
    encoded = name.encode()
    at = data.index(struct.pack("<Q", len(encoded)) + encoded) + 8 + len(encoded)
    (dims,) = struct.unpack_from("<I", data, at)
    struct.pack_into("<I", data, at + 4 + 8 * dims, new_type)
    path.write_bytes(bytes(data))
