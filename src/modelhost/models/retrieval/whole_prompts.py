"""Whole prompts through a decoder in one forward, nothing generated: the final hidden state
at each prompt's last token (what an embedder pools, and what a reranker's head reads).

The rows are laid out as the engine lays out a step of fresh prompts (models/batch.py): flat
tokens, each row's queries attending causally to its own keys only, so rows of different
lengths need no padding token and each row's last index is its own. There is no scheduler and
no block manager here: each row's blocks are consecutive, and one KV pool serves every layer,
since a layer writes every token's keys and values before it reads any and nothing outlives
the forward (a forward costs one layer's keys and values, not the whole stack's).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from modelhost.models.batch import ForwardBatch, KVCache
from modelhost.models.loaded import LoadedModel
from modelhost.models.networks.decoder import DecoderLM
from modelhost.models.retrieval.retrieval_files import BATCH_ROWS, BATCH_SCORES, BATCH_TOKENS

BLOCK_TOKENS = 16


def groups(lengths: Sequence[int]) -> list[tuple[int, int]]:
    """[start, end) runs of consecutive prompts, each one forward within the bounds of
    retrieval_files.py (a prompt longer than them runs alone)."""
    runs: list[tuple[int, int]] = []
    start = 0
    while start < len(lengths):
        end, longest = start, 0
        while end < len(lengths):
            widest = max(longest, lengths[end])
            rows = end - start + 1
            over = rows * widest > BATCH_TOKENS or rows * widest * widest > BATCH_SCORES
            if end > start and (over or rows > BATCH_ROWS):
                break
            longest, end = widest, end + 1
        runs.append((start, end))
        start = end
    return runs


def whole_prompt_batch(
    prompts: Sequence[Sequence[int]], *, sliding_window: int | None, device: torch.device
) -> tuple[ForwardBatch, int]:
    """The step that computes every prompt whole, wanting each one's last token; and how many
    KV blocks it writes (the pool's pad block comes after them)."""
    counts = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    rows, max_q = len(prompts), int(counts.max())
    blocks_of = (counts + BLOCK_TOKENS - 1) // BLOCK_TOKENS
    first_block = torch.cumsum(blocks_of, 0) - blocks_of
    num_blocks = int(blocks_of.sum())
    max_blocks = int(blocks_of.max())
    table_range = torch.arange(max_blocks)
    tables = torch.where(
        table_range[None, :] < blocks_of[:, None], first_block[:, None] + table_range, num_blocks
    )
    row_of_token = torch.repeat_interleave(torch.arange(rows), counts)
    offsets = torch.cumsum(counts, 0) - counts
    positions = torch.arange(int(counts.sum())) - offsets[row_of_token]
    slots = first_block[row_of_token] * BLOCK_TOKENS + positions
    q_range = torch.arange(max_q)
    q_valid = q_range[None, :] < counts[:, None]
    # Padded queries point at position 0 so their softmax row is never empty (no NaNs).
    q_pos = torch.where(q_valid, q_range[None, :], 0)
    distance = q_pos[:, :, None] - torch.arange(max_blocks * BLOCK_TOKENS)[None, None, :]
    causal = distance >= 0
    sliding = None
    if sliding_window is not None:
        sliding = (causal & (distance < sliding_window))[:, None].to(device)
    ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long)
    batch = ForwardBatch(
        input_ids=ids.to(device),
        positions=positions.to(device),
        slot_mapping=slots.to(device),
        query_index=torch.where(q_valid, offsets[:, None] + q_range[None, :], 0).to(device),
        output_index=(row_of_token * max_q + positions).to(device),
        kv_blocks=tables.to(device),
        token_blocks=tables[row_of_token].to(device),
        attn_mask=causal[:, None].to(device),
        sliding_mask=sliding,
        logits_index=(offsets + counts - 1).to(device),
        dense=rows == 1,
    )
    return batch, num_blocks


@torch.inference_mode()
def last_hidden(model: LoadedModel, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
    """[len(prompts), hidden] final hidden states (after the final norm) at each prompt's
    last token, from one forward of all the prompts (retrieval_files.py's bounds aside)."""
    network = model.network
    assert isinstance(network, DecoderLM)
    config = model.config
    batch, num_blocks = whole_prompt_batch(
        prompts, sliding_window=config.sliding_window, device=model.device
    )
    # Zeroed: attention gathers whole blocks, masked tails included, and a masked NaN from
    # unwritten memory would still poison SDPA's weighted sum (engine/runner.py).
    pool = torch.zeros(
        ((num_blocks + 1) * BLOCK_TOKENS, 2, config.num_kv_heads, config.head_dim),
        dtype=model.cache_dtype,
        device=model.device,
    )
    kv = KVCache([pool] * config.num_layers, BLOCK_TOKENS)
    return network.final_hidden(batch, kv)
