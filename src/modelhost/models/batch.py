"""The model's input for one engine step: a flat batch of mixed prefill and decode tokens.

Everything the forward pass needs is here as tensors; the model keeps no per-step state.
Attention reads the paged KV cache through `kv_blocks`, one padded row of block ids per
sequence. The native kernels read each token's row of it (`token_blocks`) in place; otherwise
each layer gathers whole blocks (keys and values together, one copy) into a dense
[rows, context, ...] tensor, so a step costs one gather and one SDPA call per layer whatever the
mix of rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] token ids of every scheduled token, rows concatenated
    positions: torch.Tensor  # [T] absolute position of each token in its sequence
    slot_mapping: torch.Tensor  # [T] flat KV slot where each token's key/value is written
    query_index: torch.Tensor  # [R, max_q] index into the T tokens for each row's queries (padded)
    output_index: torch.Tensor  # [T] position of each token in the flattened [R * max_q] grid
    kv_blocks: torch.Tensor  # [R, max_kv / block_size] KV blocks of each row (padded: zero block)
    token_blocks: torch.Tensor  # [T, max_kv / block_size] each token's row of kv_blocks
    attn_mask: torch.Tensor  # [R, 1, max_q, max_kv] bool: causal and in-range
    sliding_mask: torch.Tensor | None  # same, also inside the sliding window (Gemma 3)
    logits_index: torch.Tensor  # [S] tokens whose next-token logits are wanted
    # The T tokens already form the [R, max_q] grid (one row, or one query per row): attention
    # views them in place and skips `query_index` / `output_index`.
    dense: bool = False
    # Rows of the input embeddings to overwrite after the embedding layer (and its scaling):
    # (indices into the T tokens, [n, hidden] rows). Images enter this way: a vision tower's
    # output takes the place of its placeholder tokens' embeddings (models/vision/tower.py).
    embed_override: tuple[torch.Tensor, torch.Tensor] | None = None
    # [3, T] (temporal, height, width) rotary positions of M-RoPE models (Qwen2.5-VL), where a
    # row holds an image (models/vision/mrope.py); None: every axis takes `positions`.
    # `positions` stays each token's index in its row (KV slots, causal masks).
    mrope_positions: torch.Tensor | None = None
    # The masks let some tokens see later ones of the same step (Gemma 3: one image's soft
    # tokens attend to each other both ways). The native kernels attend causally by position,
    # so such a step takes the masked path.
    bidirectional: bool = False
    # [T] bool: prompt tokens whose logits nobody reads (each prompt's tokens before its last,
    # less those whose logprobs are asked for); None: none. The native prompt attention tiles
    # their queries against each block of keys (models/kernels/native_prompt_attention.h).
    prompt_rows: torch.Tensor | None = None
    # Those of them the quantized linears compute with 8-bit activations, or in bf16 where
    # `coarse_bf16` (--prompt-activations 8 or bf16, models/kernels/packed.py): not a prompt's
    # last block nor a short prompt's tokens (engine/runner.py `_coarse_rows`); None: none.
    coarse_rows: torch.Tensor | None = None
    coarse_bf16: bool = False
    # What the step's layers compute alike and share, made by the first that needs it (the
    # bf16 rows' runs and attention masks, models/kernels/bf16_attention.py); gone with the
    # step.
    shared: dict[object, Any] = field(default_factory=dict)


@dataclass(slots=True)
class KVCache:
    """One preallocated pool per layer, keys and values side by side, addressed by slot
    (block * block_size + offset): [num_slots, 2, num_kv_heads, head_dim], index 0 the key."""

    pools: list[torch.Tensor]
    block_size: int

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
        block_size: int,
    ) -> KVCache:
        # Zeroed and committed now: a preallocated pool (CUDA). On CPUs the engine reserves one
        # that grows with use instead (engine/kv/kv_memory.py).
        shape = (num_slots, 2, num_kv_heads, head_dim)
        pools = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        return cls(pools, block_size)

    def blocks(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s pool as [num_blocks, block_size * 2 * num_kv_heads * head_dim]."""
        pool = self.pools[layer]
        return pool.view(pool.shape[0] // self.block_size, -1)
