"""Rotary embedding values (models/networks/layers.py's Rotary), from its table or computed."""

from __future__ import annotations

import torch

from modelhost.models.networks.layers import Rotary


def reference(rotary: Rotary, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and the signed sin of each position times each frequency, in float64."""
    freqs = positions.double()[:, None] * rotary.inv_freq.double()[None]
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def test_rotary_values_are_the_same_whether_the_table_grew_before_or_after():
    growing, fresh = Rotary(64, 10_000.0), Rotary(64, 10_000.0)
    growing.cos_sin(torch.tensor([3]), torch.float32)  # a small table first, grown below
    positions = torch.tensor([0, 17, 300, 1999, 5])
    got = growing.cos_sin(positions, torch.float32)
    expected = fresh.cos_sin(positions, torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert got[0].shape == (5, 1, 64)


def test_rotary_values_past_the_table_are_computed_alike():
    rotary = Rotary(64, 10_000.0)
    positions = torch.tensor([1, Rotary.TABLE_POSITIONS - 1, Rotary.TABLE_POSITIONS, 9000])
    cos, sin = rotary.cos_sin(positions, torch.float32)
    expected_cos, expected_sin = reference(rotary, positions)
    # fp32 angles of up to 9000 radians: within a few ulps of the angle, as before the table
    assert torch.allclose(cos[:, 0].double(), expected_cos, atol=2e-3)
    assert torch.allclose(sin[:, 0].double(), expected_sin, atol=2e-3)
    table_cos, _ = rotary.cos_sin(positions[:2], torch.float32)
    assert torch.equal(table_cos, cos[:2])
