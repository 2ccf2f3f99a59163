"""A long prompt's bf16 attention on AMX tiles (models/kernels/native_amx_attention.h): what
PyTorch's flash attention answers, within bf16's precision, a query's result whatever shares its
call, and PyTorch's own AMX kernels unharmed on the same thread after it."""

from __future__ import annotations

import pytest
import torch

from modelhost.models.kernels import native

kernels = native.kernels()
pytestmark = pytest.mark.skipif(
    kernels is None or not kernels.amx, reason="this CPU has no AMX bf16 tiles"
)


BLOCK, KV_HEADS = 16, 2


def inputs(queries: int, keys: int, dim: int, seed: int = 0, dtype=torch.float16):
    """bf16 queries, and a paged pool of `keys` positions (blocks in reverse order) with its
    block table and KV head 1's keys and values as bf16 [keys, dim]."""
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn((queries, dim), generator=generator).bfloat16()
    pool = torch.randn((keys, 2, KV_HEADS, dim), generator=generator).to(dtype)
    table = torch.arange(keys // BLOCK - 1, -1, -1)
    ordered = pool.view(-1, BLOCK, 2, KV_HEADS, dim)[table].view(keys, 2, KV_HEADS, dim)
    return query, (pool, table), ordered[:, 0, 1].bfloat16(), ordered[:, 1, 1].bfloat16()


def amx(queries, paged, scale, keys=None):
    pool, table = paged
    assert kernels is not None
    count = pool.shape[0] if keys is None else keys
    return kernels.amx_attention(queries, pool, 1, table, BLOCK, count, scale)


def flash(queries, keys, values, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        queries[None, None], keys[None, None], values[None, None], 0.0, False, scale=scale
    )
    return out[0, 0].float(), lse[0, 0]


@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_amx_attention_answers_as_fp32_attention_within_bf16s_precision(dim, dtype):
    queries, paged, keys, values = inputs(64, 800, dim, dtype=dtype)
    scale = dim**-0.5
    out, lse = amx(queries, paged, scale)
    scores = (queries.float() @ keys.float().T) * scale
    expected = scores.softmax(-1) @ values.float()
    assert ((out - expected).norm() / expected.norm()) < 1e-2
    assert torch.allclose(lse, scores.logsumexp(-1), atol=1e-3)


def test_amx_attention_agrees_with_pytorchs_flash_attention_it_replaces():
    queries, paged, keys, values = inputs(2048, 4096, 64)
    out, lse = amx(queries, paged, 0.125)
    theirs, their_lse = flash(queries, keys, values, 0.125)
    assert ((out - theirs).norm() / theirs.norm()) < 1e-2
    assert torch.allclose(lse, their_lse, atol=1e-3)


def test_amx_attention_reads_only_the_positions_it_is_given():
    queries, paged, keys, values = inputs(64, 1024, 64)
    out, _ = amx(queries, paged, 0.125, keys=512)
    assert torch.allclose(out, flash(queries, keys[:512], values[:512], 0.125)[0], atol=2e-2)


def test_a_querys_amx_attention_does_not_depend_on_the_queries_beside_it():
    queries, paged, _, _ = inputs(1024, 3072, 64)  # keys over more than one span
    whole, whole_lse = amx(queries, paged, 0.125)
    for start in (0, 32, 992):
        part, part_lse = amx(queries[start : start + 32], paged, 0.125)
        assert torch.equal(part, whole[start : start + 32])
        assert torch.equal(part_lse, whole_lse[start : start + 32])


def test_pytorchs_amx_attention_answers_the_same_before_and_after_the_kernel_on_its_thread():
    # The kernel leaves the thread's tile configuration as it found it (PyTorch's brgemm may
    # keep one a thread between its calls).
    queries, paged, keys, values = inputs(512, 1024, 64)
    weight = torch.randn(64, 256).bfloat16()

    def pytorchs() -> list[torch.Tensor]:
        return [*flash(queries, keys, values, 0.125), queries @ weight]

    before = pytorchs()
    amx(queries, paged, 0.125)
    after = pytorchs()
    assert all(torch.equal(b, a) for b, a in zip(before, after, strict=True))
