"""A GGUF file's metadata (key/value section), read in a fraction of a second.

gguf's GGUFReader builds numpy views for every string of an array, ~3.5 s for SmolLM2's
49152 tokens and 48900 merges; the synthetic files copy those fields, and their tests read them
back, so this reads the key/value section alone with `struct`. Values come out as
`GGUFReader`'s `contents()` gives them (str, int, float, bool, lists of those), with the byte
span each entry holds in the file.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUF_MAGIC, GGUFValueType

V = GGUFValueType
_SCALARS = {
    V.UINT8: "<B",
    V.INT8: "<b",
    V.UINT16: "<H",
    V.INT16: "<h",
    V.UINT32: "<I",
    V.INT32: "<i",
    V.FLOAT32: "<f",
    V.BOOL: "<?",
    V.UINT64: "<Q",
    V.INT64: "<q",
    V.FLOAT64: "<d",
}


@dataclass(frozen=True, slots=True)
class Field:
    key: str
    value: Any
    types: tuple[GGUFValueType, ...]  # (type,) or (ARRAY, item type), as GGUFReader's `types`
    start: int  # the entry's bytes in the file, key included
    end: int


class _Cursor:
    def __init__(self, buffer: memoryview) -> None:
        self.buffer, self.at = buffer, 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buffer, self.at)
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        size = self.scalar("<Q")
        text = bytes(self.buffer[self.at : self.at + size]).decode("utf-8")
        self.at += size
        return text

    def value(self, vtype: GGUFValueType) -> tuple[Any, tuple[GGUFValueType, ...]]:
        if vtype == V.STRING:
            return self.string(), (vtype,)
        if vtype != V.ARRAY:
            return self.scalar(_SCALARS[vtype]), (vtype,)
        item, count = V(self.scalar("<I")), self.scalar("<Q")
        if item == V.STRING:
            return [self.string() for _ in range(count)], (vtype, item)
        if item == V.ARRAY:
            raise ValueError("nested GGUF arrays are not supported")
        dtype = np.dtype(_SCALARS[item])
        items = np.frombuffer(self.buffer, dtype, count, self.at)
        self.at += count * dtype.itemsize
        return items.tolist(), (vtype, item)


def read_fields(path: str | Path) -> list[Field]:
    """Every metadata entry of the GGUF file at `path`, in file order."""
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        buffer = memoryview(data)
        cursor = _Cursor(buffer)
        try:
            if cursor.scalar("<I") != GGUF_MAGIC:
                raise ValueError(f"{path} is not a GGUF file")
            version, _tensors, count = cursor.scalar("<I"), cursor.scalar("<Q"), cursor.scalar("<Q")
            if version < 2:
                raise ValueError(f"{path}: GGUF version {version} is not supported")
            fields = []
            for _ in range(count):
                start = cursor.at
                key = cursor.string()
                value, types = cursor.value(V(cursor.scalar("<I")))
                fields.append(Field(key, value, types, start, cursor.at))
            return fields
        finally:
            del cursor
            buffer.release()
