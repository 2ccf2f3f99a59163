"""How big the KV pool may grow when nothing sizes it, what it keeps when idle, and how many
tokens a block holds: kept apart from the engine so the registry can estimate a model without
importing PyTorch."""

from __future__ import annotations

BLOCK_TOKENS = 8  # a shared prefix is reused to within BLOCK_TOKENS - 1 tokens
DEFAULT_KV_BYTES = 1 << 30
MIN_POOL_CONTEXT = 8192  # tokens a default pool holds at least, where the window allows
# What a growing pool keeps of its prefix cache once idle (the rest of its memory goes back):
# enough for a conversation's recent turns, small beside any model's weights.
IDLE_KV_BYTES = 32 << 20
STORE_QUEUE_BYTES = 64 << 20  # see store_queue_bytes


def default_kv_bytes(
    token_bytes: int,
    context_length: int,
    block_size: int,
    batch: int,
    *,
    budgeted: bool = False,
) -> int:
    """The KV pool's ceiling when nothing sizes it: 1 GiB, but at least one context of up to
    MIN_POOL_CONTEXT tokens, and at most a full context for every row. (A 128k-token window
    alone would otherwise ask for gigabytes no request may use; a longer prompt than the pool
    holds is refused as too long.)

    `budgeted`: `context_length` is already the window the model budget holds (assembly's
    `served_window`), so the pool holds at least one whole window: an agent's 30k-token prompt
    on a model whose KV costs 128 KiB a token needs 4 GB, not the 1 GiB default. A growing pool
    commits only what rows write, so the ceiling costs nothing until a long prompt comes."""
    one_context = (context_length + block_size) * token_bytes
    floor_context = context_length if budgeted else min(context_length, MIN_POOL_CONTEXT)
    floor = (floor_context + block_size) * token_bytes
    return min(max(DEFAULT_KV_BYTES, floor), batch * one_context)


def store_queue_bytes(pool_bytes: int) -> int:
    """The most a model's prefix KV store writer queue holds (engine/kv/prefix_persistence.py):
    blocks copied out of the pool, waiting for the disk; never more than the pool itself, so a
    small model reserves little. Reserved in a busy model's claim when the store is on
    (residency/unit.py's `claim_bytes`); a block past it is not persisted then."""
    return min(STORE_QUEUE_BYTES, pool_bytes)
