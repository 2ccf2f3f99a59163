"""Paged KV block accounting: reference counts, an O(1) LRU free list and prefix reuse.

The KV pool is `num_blocks` blocks of `block_size` token slots. A sequence's block table maps
its positions to blocks. Once a block is full and its KV computed it is *committed*: it gets a
chained key, key(i) = digest(key(i - 1), tokens of block i) (engine/kv/prefix_store.py: stable
across processes, the name a disk store keeps it under too), and a later sequence whose prompt
starts with the same tokens reuses it instead of recomputing it.

A freed block keeps its key and stays findable until the free list hands it out again; that is
the prefix cache. The free list is ordered: unhashed blocks at the front (reused first), then
hashed blocks from least to most recently freed.

A growing pool (`grows=True`) starts with no block *committed*: blocks [0, num_committed) have
been handed out since the pool last shrank and hold memory; the rest are reserved address space.
A block leaves the free list before a new one is committed, and a new one is always the lowest
uncommitted id, so the committed blocks stay one range and `release_tail` can give back
everything above the highest block still in use or kept. A fixed pool (CUDA) is committed whole.
Pure Python: no torch, no asyncio.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from modelhost.engine.kv.prefix_store import ChainKey, chain_key
from modelhost.engine.sequence import Sequence

BlockKey = ChainKey
# Told of each block as it is committed: (block id, key, parent key, tokens).
CommitHook = Callable[[int, BlockKey, BlockKey | None, tuple[int, ...]], None]


class OutOfBlocks(RuntimeError):
    """`append_slots` was asked for more blocks than are free; callers check `can_append` first."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_of(
    seq: Sequence, index: int, block_size: int, parent: BlockKey | None
) -> tuple[tuple[int, ...], BlockKey]:
    """The tokens of `seq`'s block `index` and its chain key (its images' digests and its
    adapter's salt included)."""
    start, end = index * block_size, (index + 1) * block_size
    tokens = tuple(seq.token_ids[start:end])
    adapter = seq.params.adapter
    salt = adapter.kv_salt if adapter is not None else b""
    return tokens, chain_key(parent, tokens, seq.block_images(start, end), salt)


@dataclass(slots=True)
class _Block:
    block_id: int
    ref_count: int = 0
    key: BlockKey | None = None  # set once committed (full and computed), None otherwise
    parent_key: BlockKey | None = None  # key of the block before it in the chain
    token_ids: tuple[int, ...] = ()  # the block's tokens, kept to rule out hash collisions

    def clear_key(self) -> None:
        self.key = None
        self.parent_key = None
        self.token_ids = ()


@dataclass(slots=True)
class _Owner:
    """A live sequence and the chain keys of its committed blocks (hashed or duplicate)."""

    seq: Sequence
    keys: list[BlockKey] = field(default_factory=list)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, grows: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.grows = grows
        self.num_committed = 0 if grows else num_blocks
        # A growing pool's blocks are made as they are first committed: a ceiling of hundreds
        # of thousands of blocks would otherwise cost a switch ~0.15 s of objects up front.
        self._blocks = [_Block(i) for i in range(self.num_committed)]
        # Committed blocks no row holds, in hand-out order; uncommitted ones are implied.
        self._free: OrderedDict[int, None] = OrderedDict(
            (i, None) for i in range(self.num_committed)
        )
        self._key_to_block: dict[BlockKey, int] = {}
        self._owners: dict[int, _Owner] = {}  # seq_id -> owner, for every sequence holding blocks
        self.num_prefix_queries_tokens = 0
        self.num_prefix_hit_tokens = 0
        self.on_commit: CommitHook | None = None  # the engine's disk store, when it has one

    # ---- counters -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks a row may still take: free committed ones and the uncommitted rest."""
        return len(self._free) + self.num_blocks - self.num_committed

    @property
    def num_used_blocks(self) -> int:
        return self.num_committed - len(self._free)

    @property
    def num_cached_free_blocks(self) -> int:
        return sum(1 for b in self._free if self._blocks[b].key is not None)

    @property
    def prefix_hit_ratio(self) -> float:
        if self.num_prefix_queries_tokens == 0:
            return 0.0
        return self.num_prefix_hit_tokens / self.num_prefix_queries_tokens

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref_count

    def block_key(self, block_id: int) -> BlockKey | None:
        """The block's chain key while it is in the prefix cache, else None."""
        return self._blocks[block_id].key

    def fits(self, num_tokens: int) -> bool:
        """Whether `num_tokens` tokens plus one generated token could ever fit the pool."""
        return cdiv(num_tokens + 1, self.block_size) <= self.num_blocks

    # ---- prefix cache ---------------------------------------------------------------------

    def _match_prefix(self, seq: Sequence) -> list[_Block]:
        """Cached blocks covering the longest prefix of full blocks, never the last token."""
        if seq.params.prompt_logprobs:
            return []  # every prompt position's logits are wanted: compute them all
        bs = self.block_size
        hits: list[_Block] = []
        parent: BlockKey | None = None
        for i in range((seq.num_tokens - 1) // bs):
            tokens, key = block_of(seq, i, bs, parent)
            block_id = self._key_to_block.get(key)
            if block_id is None:
                break
            block = self._blocks[block_id]
            if block.parent_key != parent or block.token_ids != tokens:
                break  # a hash collision: never hand out KV for different tokens
            hits.append(block)
            parent = key
        return hits

    def can_allocate_prompt(self, seq: Sequence) -> bool:
        """Whether `allocate_prompt` followed by appending at least one token would succeed."""
        hits = self._match_prefix(seq)
        num_free_hits = sum(1 for block in hits if block.ref_count == 0)
        return self.num_free_blocks - num_free_hits >= 1

    def allocate_prompt(self, seq: Sequence) -> int:
        """Take the cached prefix blocks for a sequence being scheduled; returns cached tokens."""
        assert not seq.block_table and seq.num_computed_tokens == 0, "prompt already allocated"
        assert seq.seq_id not in self._owners, "sequence already holds blocks"
        hits = self._match_prefix(seq)
        owner = _Owner(seq)
        for block in hits:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1
            seq.block_table.append(block.block_id)
            assert block.key is not None
            owner.keys.append(block.key)
        self._owners[seq.seq_id] = owner
        num_cached = len(hits) * self.block_size
        seq.num_computed_tokens = num_cached
        self.num_prefix_queries_tokens += seq.num_tokens
        self.num_prefix_hit_tokens += num_cached
        return num_cached

    # ---- growth ---------------------------------------------------------------------------

    def _num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        needed = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, needed - len(seq.block_table))

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self._num_new_blocks(seq, num_new_tokens) <= self.num_free_blocks

    def max_appendable(self, seq: Sequence, num_new_tokens: int) -> int:
        """The largest n <= num_new_tokens for which `can_append(seq, n)` holds (maybe 0)."""
        capacity = (len(seq.block_table) + self.num_free_blocks) * self.block_size
        return max(0, min(num_new_tokens, capacity - seq.num_computed_tokens))

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow the block table to cover num_computed_tokens + num_new_tokens positions."""
        num_new = self._num_new_blocks(seq, num_new_tokens)
        if num_new > self.num_free_blocks:
            raise OutOfBlocks(f"need {num_new} blocks, {self.num_free_blocks} free")
        self._owners.setdefault(seq.seq_id, _Owner(seq))
        for _ in range(num_new):
            block = self._take_block()
            block.ref_count = 1
            seq.block_table.append(block.block_id)

    def _take_block(self) -> _Block:
        """A block for new KV: a free block that caches nothing first (the free list keeps those
        at its front), then the lowest uncommitted block while the pool may grow, and only then
        the least recently freed cached block, evicted from the prefix cache. (Growing before
        evicting keeps a busy model's prefixes, and the blocks this takes for KV read back from
        a disk store, until its pool is full; an idle engine gives the growth back.)"""
        front = next(iter(self._free), None)
        if front is not None and self._blocks[front].key is None:
            del self._free[front]
            block_id = front
        elif self.num_committed < self.num_blocks:
            block_id = self.num_committed
            self.num_committed += 1
            if block_id == len(self._blocks):
                self._blocks.append(_Block(block_id))
        else:
            block_id, _ = self._free.popitem(last=False)
        block = self._blocks[block_id]
        self._drop_key(block)
        return block

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Give every newly full, computed block its chain key so later prompts can reuse it."""
        owner = self._owners.get(seq.seq_id)
        assert owner is not None, "sequence holds no blocks"
        bs = self.block_size
        for i in range(len(owner.keys), seq.num_computed_tokens // bs):
            parent = owner.keys[-1] if owner.keys else None
            tokens, key = block_of(seq, i, bs, parent)
            owner.keys.append(key)
            block = self._blocks[seq.block_table[i]]
            assert block.key is None or block.key == key, "block committed under another key"
            if block.key is not None or key in self._key_to_block:
                continue  # already cached (a prefix hit) or a duplicate: keep the existing entry
            block.key = key
            block.parent_key = parent
            block.token_ids = tokens
            self._key_to_block[key] = block.block_id
            if self.on_commit is not None:
                self.on_commit(block.block_id, key, parent, tokens)

    # ---- blocks from elsewhere (a disk store) ---------------------------------------------

    def touch(self, key: BlockKey, parent: BlockKey | None, tokens: tuple[int, ...]) -> bool | None:
        """Whether the block keyed `key` (with this parent and these tokens) is cached: None
        when it is not; True when it is free (now the most recently freed, evicted last);
        False when a sequence holds it."""
        block_id = self._key_to_block.get(key)
        if block_id is None:
            return None
        block = self._blocks[block_id]
        if block.parent_key != parent or block.token_ids != tokens:
            return None
        if block.ref_count > 0:
            return False
        self._free.move_to_end(block_id)
        return True

    def adopt(self, key: BlockKey, parent: BlockKey | None, tokens: tuple[int, ...]) -> int:
        """Take a block (as `append_slots` would) for KV computed elsewhere and cache it under
        `key`, free and most recently freed; the caller fills its slots. Returns its id."""
        assert key not in self._key_to_block, "block already cached"
        assert len(tokens) == self.block_size
        block = self._take_block()
        block_id = block.block_id
        block.key, block.parent_key, block.token_ids = key, parent, tokens
        self._key_to_block[key] = block_id
        self._free[block_id] = None
        return block_id

    def cached_blocks(self) -> Iterator[tuple[int, BlockKey, BlockKey | None, tuple[int, ...]]]:
        """(block id, key, parent key, tokens) of every block in the prefix cache."""
        for key, block_id in list(self._key_to_block.items()):
            block = self._blocks[block_id]
            yield block_id, key, block.parent_key, block.token_ids

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks past those holding computed tokens (a rejected speculative
        guess's): never committed, they go to the front of the free list."""
        keep = cdiv(seq.num_computed_tokens, self.block_size)
        while len(seq.block_table) > keep:
            block = self._blocks[seq.block_table.pop()]
            assert block.key is None and block.ref_count == 1, "trimmed a shared block"
            block.ref_count = 0
            self._free[block.block_id] = None
            self._free.move_to_end(block.block_id, last=False)

    # ---- release --------------------------------------------------------------------------

    def free(self, seq: Sequence) -> None:
        """Drop a sequence's references; blocks reaching zero return to the free list."""
        for block_id in reversed(seq.block_table):
            block = self._blocks[block_id]
            assert block.ref_count > 0
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None  # hashed: most recently freed, evicted last
                if block.key is None:
                    self._free.move_to_end(block_id, last=False)  # unhashed: reused first
        seq.block_table.clear()
        self._owners.pop(seq.seq_id, None)

    def release_tail(self, keep_blocks: int = 0) -> int | None:
        """Uncommit the free blocks above both `keep_blocks` and the highest block in use (their
        prefix-cache entries go with them). Returns the first uncommitted block id when the pool
        shrank, else None; the caller gives that block's memory and everything above it back.
        A fixed pool never shrinks."""
        if not self.grows:
            return None
        top = self.num_committed
        while top > keep_blocks and self._blocks[top - 1].ref_count == 0:
            top -= 1
        if top == self.num_committed:
            return None
        for block_id in range(top, self.num_committed):
            self._drop_key(self._blocks[block_id])
            del self._free[block_id]
        self.num_committed = top
        return top

    def _drop_key(self, block: _Block) -> None:
        """The one place a cached block's KV stops being findable: it is handed out for other
        tokens, or its memory is given back. (A store that keeps blocks beyond memory persists
        them here, before the key goes.)"""
        if block.key is None:
            return
        if self._key_to_block.get(block.key) == block.block_id:
            del self._key_to_block[block.key]
        block.clear_key()

    # ---- addressing -----------------------------------------------------------------------

    def slot(self, seq: Sequence, position: int) -> int:
        bs = self.block_size
        return seq.block_table[position // bs] * bs + position % bs

    # ---- invariants -----------------------------------------------------------------------

    def check_invariants(self) -> None:
        bs = self.block_size
        num_used = sum(1 for b in self._blocks if b.ref_count > 0)
        assert len(self._free) + num_used == self.num_committed, "free + used != committed"
        for block_id in self._free:
            assert self._blocks[block_id].ref_count == 0, f"block {block_id} free and referenced"
            assert block_id < self.num_committed, f"free block {block_id} not committed"
        for block in self._blocks[self.num_committed :]:
            assert block.ref_count == 0 and block.key is None, f"block {block.block_id} beyond"
        refs = [0] * self.num_blocks
        for seq_id, owner in self._owners.items():
            seq = owner.seq
            assert seq.seq_id == seq_id
            assert len(seq.block_table) >= cdiv(seq.num_computed_tokens, bs)
            assert len(owner.keys) <= len(seq.block_table)
            for block_id in seq.block_table:
                assert self._blocks[block_id].ref_count > 0, f"live block {block_id} unreferenced"
                refs[block_id] += 1
        for block in self._blocks:
            assert block.ref_count == refs[block.block_id], f"block {block.block_id} refcount"
        for key, block_id in self._key_to_block.items():
            assert self._blocks[block_id].key == key, f"hash entry for block {block_id} is stale"
        for block in self._blocks:
            if block.key is not None:
                assert self._key_to_block.get(block.key) == block.block_id, "hashed block unmapped"
                assert len(block.token_ids) == bs
