"""One KV block on disk: a header that says whose block it is, its tokens, its bytes, a checksum.

    magic "MHKV" | version | model identity digest | chain key | parent key (or zeros)
    | token count | payload length | CRC-32 of all that follows the magic but the CRC itself
    | token ids (u64 LE) | payload

A file is served only when every field matches what the reader asked for: the same model
identity, the same key, parent and tokens (a digest collision is caught here), the payload's
expected length and an intact checksum. Anything else (torn by a crash, written by another
version, another model's, flipped bits) reads as absent. Pure Python, no torch.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence

MAGIC = b"MHKV"
VERSION = 1
KEY_BYTES = 32
NO_PARENT = bytes(KEY_BYTES)
_HEADER = struct.Struct(f"<4sH{KEY_BYTES}s{KEY_BYTES}s{KEY_BYTES}sIQI")
HEADER_BYTES = _HEADER.size


def file_bytes(num_tokens: int, num_payload_bytes: int) -> int:
    return HEADER_BYTES + 8 * num_tokens + num_payload_bytes


def _tokens_bytes(tokens: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}Q", *tokens)


def _checksum(fields: bytes, tokens: bytes, payload: bytes | memoryview) -> int:
    return zlib.crc32(payload, zlib.crc32(tokens, zlib.crc32(fields)))


def encode(
    identity: bytes, key: bytes, parent: bytes | None, tokens: Sequence[int], payload: bytes
) -> tuple[bytes, bytes]:
    """The file's header and token ids (written first), to be followed by `payload`."""
    token_bytes = _tokens_bytes(tokens)
    fields = (identity, key, parent or NO_PARENT, len(tokens), len(payload))
    unsummed = _HEADER.pack(MAGIC, VERSION, *fields, 0)
    crc = _checksum(unsummed[4:-4], token_bytes, payload)
    return _HEADER.pack(MAGIC, VERSION, *fields, crc), token_bytes


def decode(
    data: bytearray,
    identity: bytes,
    key: bytes,
    parent: bytes | None,
    tokens: Sequence[int],
    num_bytes: int,
) -> memoryview | None:
    """The payload of a file's bytes when they are exactly the block asked for, else None."""
    if len(data) != file_bytes(len(tokens), num_bytes):
        return None
    magic, version, ident, got_key, got_parent, num_tokens, num_payload, crc = _HEADER.unpack_from(
        data
    )
    if (magic, version, ident, got_key) != (MAGIC, VERSION, identity, key):
        return None
    if got_parent != (parent or NO_PARENT) or (num_tokens, num_payload) != (len(tokens), num_bytes):
        return None
    token_bytes = _tokens_bytes(tokens)
    end = HEADER_BYTES + len(token_bytes)
    if data[HEADER_BYTES:end] != token_bytes:
        return None
    view = memoryview(data)
    if _checksum(bytes(view[4 : HEADER_BYTES - 4]), token_bytes, view[end:]) != crc:
        return None
    return view[end:]
