"""The 8-bit KV cache's slot layout (models/kv_q8.py), without PyTorch: the registry and
admission size a q8 pool from it in processes that never load a model.

A head's key or value is head_dim int8 values in groups of GROUP, then a bf16 scale a group.
"""

from __future__ import annotations

GROUP = 32  # values a scale (a head whose size is no multiple of it takes one scale)


def groups(head_dim: int) -> int:
    return head_dim // GROUP if head_dim % GROUP == 0 else 1


def scale_bytes(head_dim: int) -> int:
    """The bytes of one head's scales: a bf16 scale a group."""
    return 2 * groups(head_dim)


def slot_width(head_dim: int) -> int:
    """The int8 columns (bytes) of one head's key or value in a q8 slot."""
    return head_dim + scale_bytes(head_dim)
