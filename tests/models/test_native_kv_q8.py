"""The native paged attention over an 8-bit KV pool (--kv-cache q8, models/kernels/
native_kv_q8.h): the bytes it stores and the attention it reads back."""

from __future__ import annotations

import pytest
import torch
from test_native import reference_attention

from modelhost.models import kv_q8
from modelhost.models.kernels import native
from modelhost.models.kv_q8_layout import slot_width
from modelhost.models.networks.layers import Rotary

kernels = native.kernels()
pytestmark = pytest.mark.skipif(
    kernels is None, reason="no g++, or neither AVX-512 VNNI nor AVX2 here"
)

BLOCK_SIZE, LENGTH = 4, 40
POSITIONS = torch.tensor([0, 39, 3, 17])  # each row's new token


def q8_step(heads: int, kv_heads: int, dim: int, magnitudes: torch.Tensor | None = None):
    """A decode step's inputs over a q8 pool of 40 cached tokens a row (rows' blocks scattered
    through the pool, block 0 the padding one); the cached keys and values as the pool holds
    them, read back as fp32."""
    torch.manual_seed(0)
    rows, blocks_per_row = len(POSITIONS), LENGTH // BLOCK_SIZE
    pool = torch.zeros(
        (1 + rows * blocks_per_row) * BLOCK_SIZE, 2, kv_heads, slot_width(dim), dtype=torch.int8
    )
    tables = torch.tensor([[1 + r + rows * j for j in range(blocks_per_row)] for r in range(rows)])
    at = torch.arange(LENGTH)
    slot = tables[:, at // BLOCK_SIZE] * BLOCK_SIZE + at % BLOCK_SIZE
    cached = torch.randn(rows, LENGTH, 2, kv_heads, dim)
    for r in range(rows):
        pool[slot[r]] = kv_q8.quantize(cached[r])
    held = kv_q8.dequantize(pool[slot], dim)  # [rows, LENGTH, 2, kv_heads, dim]
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim)
    if magnitudes is not None:
        qkv *= magnitudes
    slots = slot[torch.arange(rows), POSITIONS]
    return pool, tables, held, qkv, slots


# 10**e: values from subnormal-scale small to large; zeros: a group whose scale is 0.
MAGNITUDES = torch.cat((10.0 ** torch.randint(-30, 6, (40 * 64,)).float(), torch.zeros(64)))


@pytest.mark.parametrize("dim", [64, 48])  # groups of 32; one group where 32 does not divide
@pytest.mark.parametrize("qk_norm", [False, True])
def test_the_native_store_writes_the_bytes_kv_q8_quantize_writes(dim, qk_norm):
    heads, kv_heads = 2, 1
    width = (heads + 2 * kv_heads) * dim
    pool, tables, _, qkv, slots = q8_step(heads, kv_heads, dim, MAGNITUDES[:width])
    norm = (torch.rand(heads + kv_heads, dim) + 0.5, 1e-6) if qk_norm else None
    cos, sin = Rotary(dim, 10_000.0).cos_sin(POSITIONS, torch.float32)
    work = qkv.clone()  # normed and rotated in place
    kernels.paged_attention(
        work, heads, kv_heads, norm, (cos, sin), pool, slots, tables, BLOCK_SIZE, POSITIONS, 0, 0.2
    )  # fmt: skip
    new_kv = work[:, heads * dim :].view(len(POSITIONS), 2, kv_heads, dim)
    assert torch.equal(pool[slots], kv_q8.quantize(new_kv))


# Query heads per KV head: 3; 10 (a group of 8, then 2; one scale a head of 48); 1.
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(6, 2, 32), (10, 1, 48), (4, 4, 64)])
@pytest.mark.parametrize("window", [0, 5])
def test_native_attention_over_an_8_bit_pool_is_attention_over_its_dequantized_keys(
    heads, kv_heads, dim, window
):
    pool, tables, held, qkv, slots = q8_step(heads, kv_heads, dim)
    norm = (torch.rand(heads + kv_heads, dim) + 0.5, 1e-6)
    cos, sin = Rotary(dim, 10_000.0).cos_sin(POSITIONS, torch.float32)
    work = qkv.clone()
    got = kernels.paged_attention(
        work, heads, kv_heads, norm, (cos, sin), pool, slots, tables, BLOCK_SIZE, POSITIONS,
        window, 0.2,
    )  # fmt: skip
    # The new token's own key and value are attended as stored: quantized, then read back.
    rows = len(POSITIONS)
    stored = kv_q8.dequantize(pool[slots], dim).view(rows, 2 * kv_heads * dim)
    reference_qkv = torch.cat((work[:, : heads * dim], stored), dim=-1)
    expected = reference_attention(
        reference_qkv, heads, kv_heads, None, (torch.ones_like(cos), torch.zeros_like(sin)),
        held[:, :, 0], held[:, :, 1], POSITIONS, window, 0.2,
    )  # fmt: skip
    assert torch.allclose(got, expected, atol=1e-5)


def test_prompt_attention_refuses_an_8_bit_pool():
    heads, kv_heads, dim = 2, 1, 32
    pool, tables, _, qkv, slots = q8_step(heads, kv_heads, dim)
    cos, sin = Rotary(dim, 10_000.0).cos_sin(POSITIONS, torch.float32)
    tiled = torch.ones(len(POSITIONS), dtype=torch.bool)
    with pytest.raises(ValueError, match="8-bit"):
        kernels.prompt_attention(
            qkv, heads, kv_heads, None, (cos, sin), pool, slots, tables, BLOCK_SIZE, POSITIONS,
            tiled, 0, 0.2,
        )  # fmt: skip
