"""A long prompt's bf16 rows' attention (models/kernels/bf16_attention.py), through the AMX
kernel where this CPU has the tiles and PyTorch's flash attention elsewhere: near the fp32
reference, within a sliding window, with grouped KV heads, and a token's result the same
however its prompt was cut into steps."""

from __future__ import annotations

import math

import pytest
import torch

from modelhost.models.kernels import bf16_attention, native

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 64, 16
kernels = native.kernels()


def paged(keys: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A pool of `keys` positions' keys and values (fp16, blocks in reverse order) and the
    sequence's block table."""
    generator = torch.Generator().manual_seed(seed)
    blocks = -(-keys // BLOCK)
    pool = torch.randn((blocks * BLOCK, 2, KV_HEADS, DIM), generator=generator).half()
    table = torch.arange(blocks - 1, -1, -1)
    return pool, table


def stored(pool: torch.Tensor, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return pool[table[positions // BLOCK] * BLOCK + positions % BLOCK].float()


def reference(queries, positions, pool, table, window: int) -> torch.Tensor:
    """fp32 attention of each query [n, heads, dim] at its position."""
    out = []
    for query, position in zip(queries, positions.tolist(), strict=True):
        first = max(0, position - window + 1) if window else 0
        kv = stored(pool, table, torch.arange(first, position + 1))
        keys = kv[:, 0].repeat_interleave(HEADS // KV_HEADS, dim=1)  # [keys, heads, dim]
        values = kv[:, 1].repeat_interleave(HEADS // KV_HEADS, dim=1)
        scores = torch.einsum("hd,khd->hk", query, keys) / math.sqrt(DIM)
        out.append(torch.einsum("hk,khd->hd", scores.softmax(-1), values).reshape(-1))
    return torch.stack(out)


def attend(queries, positions, pool, table, window: int, masks=None) -> torch.Tensor:
    tokens = queries.shape[0]
    qkv = torch.zeros(tokens, (HEADS + 2 * KV_HEADS) * DIM)
    qkv[:, : HEADS * DIM] = queries.reshape(tokens, -1)
    out = torch.full((tokens, HEADS * DIM), float("nan"))
    bf16_attention.attend_runs(
        qkv,
        out,
        torch.ones(tokens, dtype=torch.bool),
        HEADS,
        KV_HEADS,
        DIM,
        pool,
        positions,
        table.expand(tokens, -1),
        BLOCK,
        window,
        1 / math.sqrt(DIM),
        masks,
    )
    return out


def test_bf16_rows_attend_as_fp32_attention_does_within_bf16s_precision():
    pool, table = paged(1700)
    # queries in four stretches of PANEL positions: the later ones attend the keys before
    # theirs unmasked, in more than one of flash's splits, and merge them with their own
    positions = torch.arange(60, 1700)
    queries = torch.randn(positions.numel(), HEADS, DIM)
    got, expected = (
        attend(queries, positions, pool, table, 0),
        reference(queries, positions, pool, table, 0),
    )
    assert ((got - expected).norm() / expected.norm()) < 1e-2


def test_bf16_rows_of_a_sliding_window_layer_see_only_their_window():
    pool, table = paged(1200)
    positions = torch.arange(1100, 1200)
    queries = torch.randn(positions.numel(), HEADS, DIM)
    got = attend(queries, positions, pool, table, 256)
    expected = reference(queries, positions, pool, table, 256)
    assert ((got - expected).norm() / expected.norm()) < 1e-2
    assert ((got - reference(queries, positions, pool, table, 0)).norm() / expected.norm()) > 0.1


def test_a_bf16_rows_attention_does_not_depend_on_how_its_prompt_was_cut_into_steps():
    pool, table = paged(1100)
    positions = torch.arange(0, 1100)
    queries = torch.randn(positions.numel(), HEADS, DIM)
    whole = attend(queries, positions, pool, table, 0)
    for start, stop in ((0, 37), (37, 600), (600, 1100), (513, 514)):
        piece = attend(queries[start:stop], positions[start:stop], pool, table, 0)
        assert torch.equal(piece, whole[start:stop])


def test_a_steps_layers_sharing_their_masks_attend_as_each_would_alone():
    pool, table = paged(1300)
    positions = torch.arange(700, 1300)
    shared: dict[object, object] = {}
    for window in (0, 256, 0, 256):  # global and sliding layers, as Gemma 3 interleaves them
        queries = torch.randn(positions.numel(), HEADS, DIM)
        alone = attend(queries, positions, pool, table, window)
        assert torch.equal(attend(queries, positions, pool, table, window, shared), alone)


def test_runs_split_the_marked_tokens_by_sequence_and_by_gaps_in_position():
    positions = torch.tensor([5, 6, 7, 0, 1, 9, 10, 12])
    tables = torch.tensor([[1], [1], [1], [2], [2], [2], [2], [2]])
    marked = torch.tensor([True, True, True, True, True, False, True, True])
    assert [run.tolist() for run in bf16_attention.runs(marked, positions, tables)] == [
        [0, 1, 2],
        [3, 4],
        [6],
        [7],
    ]


@pytest.mark.skipif(kernels is None or not kernels.amx, reason="this CPU has no AMX bf16 tiles")
def test_bf16_rows_attend_alike_through_the_amx_kernel_and_through_pytorchs_flash(monkeypatch):
    pool, table = paged(1700)
    positions = torch.arange(900, 1700)  # keys before their stretch: the AMX kernel's
    queries = torch.randn(positions.numel(), HEADS, DIM)
    through_amx = attend(queries, positions, pool, table, 0)
    assert kernels is not None
    monkeypatch.setattr(kernels, "amx", False)
    through_flash = attend(queries, positions, pool, table, 0)
    assert ((through_amx - through_flash).norm() / through_flash.norm()) < 1e-2
    assert not torch.equal(through_amx, through_flash)  # two kernels, not one taken twice
