"""A long prompt's bf16 rows (--prompt-activations bf16) attend through PyTorch's CPU flash
attention in bf16, which oneDNN's brgemm runs on AMX tiles: about 3x the native tiled
attention's rate (native_prompt_attention.h) on the same keys.

The native kernel norms and rotates the step's queries and keys and stores the keys first
(mh_prompt_attention with these tokens marked ATTENDED_BY_CALLER); here each run of a
sequence's consecutive bf16 tokens gathers its keys and values from the paged pool and attends
them: up to PANEL queries a call, against keys that start at a multiple of PANEL positions (0,
or the sliding window's first block) and are padded to a multiple of PANEL. The flash kernel
splits the keys by their count alone, so a token's result depends on its own query and keys,
not on its neighbours in the step nor on how its prompt was chunked (a prefix-cache hit agrees
with a cold prefill). Its result does not depend on how many queries share the call either
(measured bit for bit from 2 to 2,048), except for a query alone, which takes another path: a
call's queries are padded to a multiple of QUERY_ROWS, not to PANEL, so a turn's few hundred
new tokens do not pay for 512, and the query heads that share a KV head go in one call.
"""

from __future__ import annotations

from typing import Any

import torch

from modelhost.models.kernels.native import ATTENDED_BY_CALLER

PANEL = 512  # the most queries a call, and the alignment and padding of keys
QUERY_ROWS = 64  # a call's queries, padded to a multiple of this (never one alone)


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
    shared: dict[object, Any] | None = None,
) -> None:
    """out[t] = token t's attention for every token marked (fp32 [T, heads * head_dim]), from
    qkv's normed and rotated queries and the pool's stored keys and values. `shared`: the
    step's, where its layers keep the runs and the masks they all use (finding the runs of 600
    tokens over a 20k context's tables takes ~3 ms, a 512-query mask over it ~15-30 ms)."""
    group = heads // kv_heads
    found = shared.get(("runs", id(marked))) if shared is not None else None
    if found is None:
        found = runs(marked, positions, tables)
        if shared is not None:
            shared[("runs", id(marked))] = found
    for run in found:
        first, last = int(positions[run[0]]), int(positions[run[-1]])
        start = max(0, first - window + 1) // PANEL * PANEL if window > 0 else 0
        keys, values = _gathered(pool, tables[run[0]], block_size, start, last + 1)
        queries = qkv[run, : heads * head_dim].view(-1, heads, head_dim)
        key_positions = torch.arange(start, start + keys.shape[1])
        for at in range(0, run.numel(), PANEL):
            rows = min(PANEL, run.numel() - at)
            padded = -(-rows // QUERY_ROWS) * QUERY_ROWS
            panel = torch.zeros((heads, padded, head_dim), dtype=torch.bfloat16)
            panel[:, :rows] = queries[at : at + rows].transpose(0, 1)
            at_first = int(positions[run[at]])
            seen = (at_first, rows, padded, first, start, keys.shape[1], window, group)
            mask = shared.get(seen) if shared is not None else None
            if mask is None:  # a run's positions are consecutive: `seen` says them all
                query_positions = torch.full((padded,), first, dtype=torch.long)
                query_positions[:rows] = positions[run[at : at + rows]]
                # One mask a query head of a group (the group's queries go in one call)
                mask = _mask(query_positions, key_positions, window).repeat(group, 1)
                if shared is not None:
                    shared[seen] = mask
            result = torch.empty((heads, rows, head_dim), dtype=torch.bfloat16)
            for h in range(kv_heads):
                # The query heads that share a KV head as one head of `group` times the
                # queries: each key is read once for them all (Gemma 3's 4 heads over a 20k
                # context: ~1.6x faster), and a query's result is the same (flash's sums
                # follow the keys' split alone).
                folded = panel[h * group : (h + 1) * group].reshape(1, 1, -1, head_dim)
                attended = _flash(folded, keys[h][None, None], values[h][None, None], mask, scale)
                result[h * group : (h + 1) * group] = attended.view(group, padded, -1)[:, :rows]
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
    first, last = start // block_size, -(-stop // block_size)
    blocks = pool.view(-1, block_size, *pool.shape[1:]).index_select(0, table[first:last])
    skip = start - first * block_size
    stored = blocks.view(-1, *pool.shape[1:])[skip : skip + stop - start]  # [keys, 2, kv, dim]
    padded = -(-(stop - start) // PANEL) * PANEL
    both = torch.empty((2, pool.shape[2], padded, pool.shape[-1]), dtype=torch.bfloat16)
    both[:, :, stop - start :] = 0
    both[:, :, : stop - start].copy_(stored.permute(1, 2, 0, 3))
    return both[0], both[1]


def _mask(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int) -> torch.Tensor:
    """[queries, keys] bf16: 0 where a query sees a key (causal, within the window), -inf
    elsewhere."""
    seen = key_positions[None, :] <= query_positions[:, None]
    if window > 0:
        seen &= key_positions[None, :] > query_positions[:, None] - window
    mask = torch.zeros(seen.shape, dtype=torch.bfloat16)
    return mask.masked_fill_(~seen, float("-inf"))
