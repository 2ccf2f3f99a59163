"""A long prompt's bf16 rows (--prompt-activations bf16) attend in bf16 on AMX tiles: about 3x the
native tiled attention's rate (native_prompt_attention.h) on the same keys through PyTorch's CPU
flash attention (oneDNN's brgemm), and 1.3-1.8x that through the native AMX kernel
(native_amx_attention.h), which takes the keys before a panel's stretch, unmasked.

The native kernel norms and rotates the step's queries and keys and stores the keys first
(mh_prompt_attention with these tokens marked ATTENDED_BY_CALLER); here each run of a sequence's
consecutive bf16 tokens gathers its keys and values from the paged pool (with the AMX kernel,
its own stretches' alone: the kernel reads the earlier ones from the pool) and attends them, a
panel of queries a call: the queries of one stretch of PANEL positions (a multiple of PANEL to
the next). A global layer's panel attends the keys before its stretch without a mask and its
stretch's own keys with a causal one, and merges the two by their log-sum-exps; a sliding
window's attends its window's keys, from a multiple of PANEL, under one mask. Both kernels split
the keys by their count alone, so a token's result depends on its own position, query and keys,
not on its neighbours in the step nor on how its prompt was chunked (a prefix-cache hit agrees
with a cold prefill). Its result does not depend on how many queries share the call either
(measured bit for bit from 2 to 2,048), except for a query alone, which takes another path: a
call's queries are padded to a multiple of QUERY_ROWS, not to PANEL, so a turn's few hundred new
tokens do not pay for 512, and the query heads that share a KV head go in one call.
"""

from __future__ import annotations

from typing import Any

import torch

from modelhost.models.kernels import native

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
    tokens over a 20k context's tables takes ~3 ms)."""
    group = heads // kv_heads
    found = shared.get(("runs", id(marked))) if shared is not None else None
    if found is None:
        found = runs(marked, positions, tables)
        if shared is not None:
            shared[("runs", id(marked))] = found
    masks = shared if shared is not None else {}
    kernels = native.kernels()
    # The keys before each panel's stretch go to the AMX kernel straight from the pool, so only
    # the run's own stretches are gathered.
    amx = window == 0 and kernels is not None and kernels.amx_attention_takes(pool, head_dim)
    for run in found:
        first, last = int(positions[run[0]]), int(positions[run[-1]])
        if window > 0:
            start = max(0, first - window + 1) // PANEL * PANEL
        else:
            start = first // PANEL * PANEL if amx else 0
        keys, values = _gathered(pool, tables[run[0]], block_size, start, last + 1)
        queries = qkv[run, : heads * head_dim].view(-1, heads, head_dim)
        for at, rows in _panels(first, run.numel()):
            padded = -(-rows // QUERY_ROWS) * QUERY_ROWS
            panel = torch.zeros((heads, padded, head_dim), dtype=torch.bfloat16)
            panel[:, :rows] = queries[at : at + rows].transpose(0, 1)
            at_first = first + at
            if window > 0:  # the window's keys, under one mask
                bulk, tail = 0, (0, keys.shape[1])
            else:
                # The keys before the panel's own stretch of PANEL positions are seen by all of
                # its queries: no mask over them (a mask over a 32k context is 1.7x slower to
                # read through than the keys), merged with the stretch's own masked keys.
                bulk = at_first // PANEL * PANEL
                tail = (bulk - start, bulk - start + PANEL)
            seen = (at_first, rows, padded, start + tail[0], tail[1] - tail[0], window, group)
            mask = masks.get(seen)
            if mask is None:
                query_positions = torch.full((padded,), at_first, dtype=torch.long)
                query_positions[:rows] = torch.arange(at_first, at_first + rows)
                key_positions = torch.arange(start + tail[0], start + tail[1])
                # One mask a query head of a group (the group's queries go in one call)
                mask = _mask(query_positions, key_positions, window).repeat(group, 1)
                masks[seen] = mask
            result = torch.empty((heads, rows, head_dim), dtype=torch.float32)
            for h in range(kv_heads):
                # The query heads that share a KV head as one head of `group` times the
                # queries: each key is read once for them all (Gemma 3's 4 heads over a 20k
                # context: ~1.6x faster), and a query's result is the same (flash's sums
                # follow the keys' split alone).
                folded = panel[h * group : (h + 1) * group].reshape(1, 1, -1, head_dim)
                head_keys, head_values = keys[h][None, None], values[h][None, None]
                attended, spread = _flash(
                    folded,
                    head_keys[:, :, tail[0] : tail[1]],
                    head_values[:, :, tail[0] : tail[1]],
                    mask,
                    scale,
                )
                if bulk > 0:
                    earlier, earlier_spread = _earlier(
                        folded, kernels if amx else None, keys[h], values[h], pool, h,
                        tables[run[0]], block_size, bulk, scale,
                    )  # fmt: skip
                    merged = _merged(earlier, earlier_spread, attended, spread)
                else:
                    merged = attended.float()
                result[h * group : (h + 1) * group] = merged.view(group, padded, -1)[:, :rows]
            out[run[at : at + rows]] = result.transpose(0, 1).reshape(rows, -1)


def _panels(first: int, count: int) -> list[tuple[int, int]]:
    """A run's queries (at, rows) in panels of at most PANEL that never cross a multiple of
    PANEL positions, so that a query's keys split the same way whichever step it came in."""
    panels, at = [], 0
    while at < count:
        rows = min(count - at, PANEL - (first + at) % PANEL)
        panels.append((at, rows))
        at += rows
    return panels


def _merged(
    earlier: torch.Tensor, earlier_spread: torch.Tensor, later: torch.Tensor, spread: torch.Tensor
) -> torch.Tensor:
    """Two flash attentions of the same queries over disjoint keys as one (fp32), by their
    softmaxes' log-sum-exps."""
    top = torch.maximum(earlier_spread, spread)
    weight, later_weight = (earlier_spread - top).exp_(), (spread - top).exp_()
    total = weight + later_weight
    merged = earlier.float().mul_((weight / total)[..., None])
    return merged.add_(later.float().mul_((later_weight / total)[..., None]))


def _earlier(
    queries: torch.Tensor,
    kernels: native.Kernels | None,
    keys: torch.Tensor,
    values: torch.Tensor,
    pool: torch.Tensor,
    kv_head: int,
    table: torch.Tensor,
    block_size: int,
    count: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A panel's queries [1, 1, queries, dim] against the first `count` keys, unmasked: on AMX
    tiles straight from the pool with `kernels`, else through PyTorch's flash attention over the
    gathered keys and values [keys, dim] (from position 0)."""
    if kernels is not None:
        out, spread = kernels.amx_attention(
            queries.view(-1, queries.shape[-1]), pool, kv_head, table, block_size, count, scale
        )
        return out[None, None], spread[None, None]
    return _flash(queries, keys[None, None, :count], values[None, None, :count], None, scale)


def _flash(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch's CPU flash attention [1, heads, queries, dim] and its rows' log-sum-exps."""
    out, spread = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        queries, keys, values, 0.0, False, attn_mask=mask, scale=scale
    )
    return out, spread


def marks(prompt_rows: torch.Tensor, bf16_rows: torch.Tensor) -> torch.Tensor:
    """mh_prompt_attention's marks: the bf16 rows left to attend_runs, the other prompt rows
    tiled."""
    tiled = prompt_rows.to(torch.uint8)
    tiled[bf16_rows] = native.ATTENDED_BY_CALLER
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
