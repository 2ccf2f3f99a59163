"""A long prompt's bf16 rows (--prompt-activations bf16) attend through PyTorch's CPU flash
attention in bf16, which oneDNN's brgemm runs on AMX tiles: about 3x the native tiled
attention's rate (native_prompt_attention.h) on the same keys.

The native kernel norms and rotates the step's queries and keys and stores the keys first
(mh_prompt_attention with these tokens marked ATTENDED_BY_CALLER); here each run of a
sequence's consecutive bf16 tokens gathers its keys and values from the paged pool and attends
them in fixed shapes: PANEL queries a call (zeros pad the last panel) against keys that start
at a multiple of PANEL positions (0, or the sliding window's first block) and are padded to a
multiple of PANEL. The flash kernel splits queries and keys by those shapes alone, so a
token's result depends on its own query and keys, not on its neighbours in the step nor on how
its prompt was chunked (a prefix-cache hit agrees with a cold prefill).
"""

from __future__ import annotations

import torch

from modelhost.models.kernels.native import ATTENDED_BY_CALLER

PANEL = 512  # queries a call, and the alignment and padding of keys


def runs(marked: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor) -> list[torch.Tensor]:
    """The marked tokens' indices [T] bool, split into runs of one sequence's consecutive
    positions (the same block table)."""
    index = marked.nonzero().view(-1)
    if index.numel() == 0:
        return []
    position = positions[index]
    breaks = (position[1:] != position[:-1] + 1) | (tables[index[1:]] != tables[index[:-1]]).any(1)
    starts = [0, *(breaks.nonzero().view(-1) + 1).tolist(), index.numel()]
    return [index[a:b] for a, b in zip(starts[:-1], starts[1:], strict=True)]


def attend_runs(
    qkv: torch.Tensor,
    out: torch.Tensor,
    marked: torch.Tensor,
    heads: int,
    kv_heads: int,
    head_dim: int,
    pool: torch.Tensor,
    positions: torch.Tensor,
    tables: torch.Tensor,
    block_size: int,
    window: int,
    scale: float,
) -> None:
    """out[t] = token t's attention for every token marked (fp32 [T, heads * head_dim]), from
    qkv's normed and rotated queries and the pool's stored keys and values."""
    group = heads // kv_heads
    for run in runs(marked, positions, tables):
        first, last = int(positions[run[0]]), int(positions[run[-1]])
        start = max(0, first - window + 1) // PANEL * PANEL if window > 0 else 0
        keys, values = _gathered(pool, tables[run[0]], block_size, start, last + 1)
        queries = qkv[run, : heads * head_dim].view(-1, heads, head_dim)
        key_positions = torch.arange(start, start + keys.shape[1])
        for at in range(0, run.numel(), PANEL):
            rows = min(PANEL, run.numel() - at)
            panel = torch.zeros((heads, PANEL, head_dim), dtype=torch.bfloat16)
            panel[:, :rows] = queries[at : at + rows].transpose(0, 1)
            query_positions = torch.full((PANEL,), first, dtype=torch.long)
            query_positions[:rows] = positions[run[at : at + rows]]
            mask = _mask(query_positions, key_positions, window)
            result = torch.empty((heads, rows, head_dim), dtype=torch.bfloat16)
            for h in range(kv_heads):  # a KV head's keys shared by its query heads, uncopied
                shape = (1, group, keys.shape[1], head_dim)
                result[h * group : (h + 1) * group] = _flash(
                    panel[None, h * group : (h + 1) * group],
                    keys[h][None, None].expand(shape),
                    values[h][None, None].expand(shape),
                    mask,
                    scale,
                )[0, :, :rows]
            out[run[at : at + rows]] = result.transpose(0, 1).reshape(rows, -1).float()


def _flash(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """PyTorch's CPU flash attention [1, heads, queries, dim] (its output alone)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        queries, keys, values, 0.0, False, attn_mask=mask, scale=scale
    )[0]


def marks(prompt_rows: torch.Tensor, bf16_rows: torch.Tensor) -> torch.Tensor:
    """mh_prompt_attention's marks: the bf16 rows left to attend_runs, the other prompt rows
    tiled."""
    tiled = prompt_rows.to(torch.uint8)
    tiled[bf16_rows] = ATTENDED_BY_CALLER
    return tiled


def _gathered(
    pool: torch.Tensor, table: torch.Tensor, block_size: int, start: int, stop: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of positions start .. stop - 1 as bf16 [kv_heads, padded, head_dim]
    (zeros up to a multiple of PANEL positions)."""
    position = torch.arange(start, stop)
    slots = table[position // block_size] * block_size + position % block_size
    stored = pool.index_select(0, slots)  # [keys, 2, kv_heads, head_dim]
    padded = -(-(stop - start) // PANEL) * PANEL
    both = torch.zeros((2, pool.shape[2], padded, pool.shape[-1]), dtype=torch.bfloat16)
    both[:, :, : stop - start] = stored.permute(1, 2, 0, 3)
    return both[0], both[1]


def _mask(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int) -> torch.Tensor:
    """[queries, keys] bf16: 0 where a query sees a key (causal, within the window), -inf
    elsewhere."""
    seen = key_positions[None, :] <= query_positions[:, None]
    if window > 0:
        seen &= key_positions[None, :] > query_positions[:, None] - window
    mask = torch.zeros(seen.shape, dtype=torch.bfloat16)
    return mask.masked_fill_(~seen, float("-inf"))
