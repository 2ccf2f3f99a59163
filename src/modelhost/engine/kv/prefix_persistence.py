"""The engine's side of a prefix store: full blocks go out as they are committed, and come back
when a prompt's prefix is missing from memory, so a model that returns after its worker ended
does not prefill again what it had seen.

Out: the engine thread copies a just-committed block's bytes from each layer (a memcpy of a few
hundred KB) onto a queue bounded in bytes (`store_queue_bytes`), and a writer thread hands them to
the store. The queue's bytes are the model's memory: `queued_bytes` counts them in what the
engine holds, and the residency budget reserves the bound in a busy model's claim
(residency/unit.py's `claim_bytes`), so a queue that fills never takes memory nobody counted.
A block that does not fit is skipped, never waited for: the engine thread does not block on
the disk. `close` lets the writer finish what is queued, then writes every cached block the
store still lacks itself, one block at a time.
In: before a new row is queued, its prompt's chain is walked block by block; blocks memory lacks
are read from the store into free pool blocks and cached there, so the ordinary prefix match
finds them (and `cached_tokens` counts them). Runs on the engine thread except the writer.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import torch

from modelhost.engine.kv.block_manager import BlockKey, BlockManager, block_of, cdiv
from modelhost.engine.kv.kv_pool_size import store_queue_bytes
from modelhost.engine.kv.prefix_store import PrefixStore
from modelhost.engine.sequence import Sequence
from modelhost.models.batch import KVCache

log = logging.getLogger(__name__)

_Pending = tuple[BlockKey, BlockKey | None, tuple[int, ...], bytes]


def kv_layout(kv: KVCache) -> str:
    """What the bytes of a block mean: a store keeps blocks of one layout apart from others."""
    pool = kv.pools[0]
    _, pair, heads, head_dim = pool.shape
    return (
        f"block={kv.block_size};layers={len(kv.pools)};kv={pair}x{heads}x{head_dim};"
        f"dtype={str(pool.dtype).removeprefix('torch.')};device={pool.device.type}"
    )


def block_bytes(kv: KVCache, block_id: int) -> bytes:
    """A block's keys and values, layer after layer, as bytes (a copy)."""
    start = block_id * kv.block_size
    parts = torch.stack([pool[start : start + kv.block_size] for pool in kv.pools])
    return parts.view(torch.uint8).cpu().numpy().tobytes()


def block_tensor(kv: KVCache, payload: memoryview) -> torch.Tensor:
    """`block_bytes` output as [layers, block_size, 2, kv_heads, head_dim] (no copy)."""
    pool = kv.pools[0]
    shape = (len(kv.pools), kv.block_size, *pool.shape[1:])
    return torch.frombuffer(payload, dtype=pool.dtype).view(shape)


def pool_bytes(kv: KVCache) -> list[memoryview] | None:
    """Each layer's pool as bytes, where they are in this process's memory (CPU pools)."""
    if kv.pools[0].device.type != "cpu":
        return None
    return [memoryview(pool.view(torch.uint8).numpy()).cast("B") for pool in kv.pools]  # type: ignore[arg-type]


def fill_block(
    kv: KVCache, block_id: int, payload: memoryview, layers: list[memoryview] | None
) -> None:
    """Write a block's `block_bytes` into block `block_id` of every layer: byte copies into
    `layers` (`pool_bytes`: a tensor copy's dispatch cost ~10 us a layer, half a 20k-token
    restore), else tensor copies."""
    if layers is None:
        parts = block_tensor(kv, payload)
        start = block_id * kv.block_size
        for layer, pool in enumerate(kv.pools):
            pool[start : start + kv.block_size].copy_(parts[layer])
        return
    size = len(payload) // len(layers)
    at = block_id * size
    for layer, place in enumerate(layers):
        place[at : at + size] = payload[layer * size : (layer + 1) * size]


class PrefixPersistence:
    def __init__(self, store: PrefixStore, kv: KVCache, block_manager: BlockManager) -> None:
        self.store = store
        self.kv = kv
        self.block_manager = block_manager
        pool = kv.pools[0]
        self.block_bytes = len(kv.pools) * kv.block_size * pool[0].numel() * pool.element_size()
        self._pool_bytes = pool_bytes(kv)  # the pools are the engine's for its whole life
        # The most `_queued_bytes` may reach: what the residency budget reserved for it.
        self.queue_bytes = store_queue_bytes(block_manager.num_blocks * self.block_bytes)
        self.num_restored_tokens = 0
        self.num_written_blocks = 0
        self.num_skipped_blocks = 0
        self._known: set[BlockKey] = set()  # keys this engine wrote or read: in the store
        self._queue: queue.SimpleQueue[_Pending | None] = queue.SimpleQueue()
        self._queued_lock = threading.Lock()
        self._queued_bytes = 0  # payloads copied and not yet written
        self._writer = threading.Thread(target=self._write_all, name="kv-store-writer", daemon=True)
        self._writer.start()
        block_manager.on_commit = self._committed

    @property
    def queued_bytes(self) -> int:
        """Bytes copied out of the pool and waiting for the writer (at most `queue_bytes`)."""
        return self._queued_bytes

    # ---- out ------------------------------------------------------------------------------

    def _committed(
        self, block_id: int, key: BlockKey, parent: BlockKey | None, tokens: tuple[int, ...]
    ) -> None:
        if key in self._known:
            return
        with self._queued_lock:
            room = self._queued_bytes + self.block_bytes <= self.queue_bytes
            if room:
                self._queued_bytes += self.block_bytes
        if not room:
            # The writer is behind (a slow disk, a burst of prompts): this block is not
            # persisted now rather than make the engine thread wait or the queue outgrow what
            # the budget reserved. It stays unknown, so `close` writes it if the pool still
            # caches it then, and a later commit of the same prefix may queue it again.
            self.num_skipped_blocks += 1
            return
        try:
            payload = block_bytes(self.kv, block_id)
        except BaseException:
            with self._queued_lock:
                self._queued_bytes -= self.block_bytes
            raise
        self._known.add(key)
        self._queue.put((key, parent, tokens, payload))

    def _write_all(self) -> None:
        while (item := self._queue.get()) is not None:
            # Written even where a file has the name: it may be torn or another's (a read
            # that found it so removed it, but files past the first bad one were never read).
            try:
                self.store.put(*item)
                self.num_written_blocks += 1
            except Exception:  # a store that fails costs a later prefill, never the writer
                log.exception("writing a block to the KV store failed")
            with self._queued_lock:
                self._queued_bytes -= self.block_bytes

    def close(self) -> None:
        """Let the writer write what is queued and end, then write every cached block the store
        lacks, one at a time (engine thread, after its last step: a drain, an unload, a
        worker's or the server's end)."""
        self.block_manager.on_commit = None
        self._queue.put(None)
        self._writer.join()
        for block_id, key, parent, tokens in self.block_manager.cached_blocks():
            if key not in self._known or not self.store.has(key):
                self.store.put(key, parent, tokens, block_bytes(self.kv, block_id))
                self._known.add(key)
                self.num_written_blocks += 1

    # ---- in -------------------------------------------------------------------------------

    def restore(self, seq: Sequence) -> int:
        """Cache in memory the blocks of `seq`'s prompt that the store holds and memory lacks
        (up to the first block neither has); returns the tokens read from the store."""
        if seq.params.prompt_logprobs:
            return 0  # every prompt position is computed anyway
        started = time.perf_counter()
        bm = self.block_manager
        bs = bm.block_size
        parent: BlockKey | None = None
        kept = 0  # free blocks this prompt will take: touched or filled here, evicted last
        restored = 0
        for i in range((seq.num_tokens - 1) // bs):  # never the last token (as the match)
            tokens, key = block_of(seq, i, bs, parent)
            cached = bm.touch(key, parent, tokens)
            if cached is None:
                rest = cdiv(seq.num_tokens - (i + 1) * bs + 1, bs)
                if bm.num_free_blocks - kept <= rest:
                    break  # the blocks still to compute need the room
                payload = self.store.get(key, parent, tokens, self.block_bytes)
                if payload is None or len(payload) != self.block_bytes:
                    break
                fill_block(self.kv, bm.adopt(key, parent, tokens), payload, self._pool_bytes)
                self._known.add(key)
                restored += 1
                kept += 1
            elif cached:
                kept += 1
            parent = key
        if restored:
            ms = (time.perf_counter() - started) * 1000
            log.info(
                "restored %d tokens of a prompt from the KV store in %.0f ms", restored * bs, ms
            )
        self.num_restored_tokens += restored * bs
        return restored * bs
