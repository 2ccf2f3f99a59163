"""The model's input for one engine step: a flat batch of mixed prefill and decode tokens.

Everything the forward pass needs is here as tensors; the model keeps no per-step state.
Attention reads the paged KV cache through `kv_slots`, one padded row per sequence, so a step
costs one batched SDPA call per layer whatever the mix of rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] token ids of every scheduled token, rows concatenated
    positions: torch.Tensor  # [T] absolute position of each token in its sequence
    slot_mapping: torch.Tensor  # [T] flat KV slot where each token's key/value is written
    query_index: torch.Tensor  # [R, max_q] index into the T tokens for each row's queries (padded)
    output_index: torch.Tensor  # [T] position of each token in the flattened [R * max_q] grid
    kv_slots: torch.Tensor  # [R, max_kv] flat KV slots of each row's context (padded)
    attn_mask: torch.Tensor  # [R, 1, max_q, max_kv] bool: causal and in-range
    sliding_mask: torch.Tensor | None  # same, also inside the sliding window (Gemma 3)
    logits_index: torch.Tensor  # [S] tokens whose next-token logits are wanted


@dataclass(slots=True)
class KVCache:
    """One preallocated pool per model: keys and values of every layer, addressed by slot."""

    keys: list[torch.Tensor]  # per layer [num_slots, num_kv_heads, head_dim]
    values: list[torch.Tensor]

    @classmethod
    def allocate(
        cls,
        *,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> KVCache:
        # torch.empty: pages are committed only as blocks are first written.
        shape = (num_slots, num_kv_heads, head_dim)
        keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        return cls(keys, values)
