"""What the engine asks of a place that keeps full KV blocks beyond its own memory (the disk
store under MODELHOST_HOME/kv, residency/kv/kv_store.py): bytes in, bytes out, by chain key.

A block's chain key is a stable digest of its parent's key and its own tokens,
key(i) = blake2b(key(i - 1) || tokens of block i), so the same prefix has the same keys in every
process and after a restart (Python's `hash` is salted per process). A block over an image's
placeholder tokens also digests the image's content hash (`images`): two images have the same
placeholder ids, never the same KV. A row run with a LoRA adapter salts every key with the
adapter's identity and scale (`salt`): the same tokens under another adapter, another scale or
the bare base are other KV, never shared. The block manager keys its
in-memory prefix cache by the same digest, so a block moves between memory and the store under
one name. Pure Python: no torch.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from typing import Protocol

ChainKey = bytes
CHAIN_KEY_BYTES = 32


def chain_key(
    parent: ChainKey | None, tokens: Sequence[int], images: bytes = b"", salt: bytes = b""
) -> ChainKey:
    """The stable key of a block holding `tokens` after the block keyed `parent` (None: first);
    `images`: the content digests of the images among those tokens (text alone: none);
    `salt`: what else the block's KV depends on (a LoRA adapter and its scale; none: the base)."""
    digest = hashlib.blake2b(parent or b"", digest_size=CHAIN_KEY_BYTES)
    digest.update(struct.pack(f"<{len(tokens)}Q", *tokens))
    if images:
        digest.update(b"images")
        digest.update(images)
    if salt:
        digest.update(b"adapter")
        digest.update(salt)
    return digest.digest()


class PrefixStore(Protocol):
    """One model's blocks (one KV layout): what `PrefixStoreOpener` returns."""

    def get(
        self, key: ChainKey, parent: ChainKey | None, tokens: Sequence[int], num_bytes: int
    ) -> memoryview | None:
        """The block's bytes (writable, `num_bytes` long), or None when the store lacks it or
        holds something else under its name (that file is removed, never served)."""
        ...

    def put(
        self, key: ChainKey, parent: ChainKey | None, tokens: Sequence[int], payload: bytes
    ) -> None:
        """Keep the block (from any thread; a failure to write is logged and forgotten)."""
        ...

    def has(self, key: ChainKey) -> bool: ...


# Called once by the engine with a description of its KV layout (block size, layers, heads,
# dtype): the store to use for this model and layout, which the opener binds to the model's
# own identity (its file, how its weights are held).
PrefixStoreOpener = Callable[[str], PrefixStore]
