"""Building blocks shared by the architectures: norms, rotary embedding, MLP, paged attention."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from modelhost.models import kv_q8, kv_q8_layout
from modelhost.models.batch import ForwardBatch, KVCache
from modelhost.models.kernels import bf16_attention, native

# Prompt steps whose rows' contexts fit in this many tokens attend natively, one query at a
# time over the paged keys; beyond it SDPA, whose tiles reuse each key across many queries,
# catches up. A fresh prompt's attention in one layer, native against SDPA (ms): SmolLM2's
# heads 0.6 / 1.1 at 128 tokens, 2.0 / 2.3 at 256; 16 heads of 128 over 8 KV heads 2.6 / 4.6
# and 7.6 / 7.7, then 14.9 / 13.2 at 384. Decode steps (one query a row) always attend natively.
NATIVE_PROMPT_CONTEXT = 256


class RMSNorm(nn.Module):
    """x / rms(x) * weight. Gemma's (1 + w) form is folded into `weight` by the loaders."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype:
            x = x.to(self.weight.dtype)  # a PyTorch quantized kernel's bf16 output
        kernels = native.kernels()
        if kernels is not None and native.readable(x) and not torch.is_grad_enabled():
            return kernels.rms_norm(x, self.weight, self.eps)  # ~25 us less than torch's
        # torch.rms_norm, not F.rms_norm: the functional wrapper costs ~20 us a call on CPU.
        return torch.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Rotary:
    """NEOX-style rotary embedding (rotate halves), computed once per step per base.

    `freq_factors` divide the frequencies one by one (Llama 3.1, longrope); `rope_dim` below
    head_dim rotates only that many dimensions (partial rotary): the loader orders q and k
    rows so they are the pairs (i, i + head_dim / 2) for i < rope_dim / 2, and the rest get
    frequency 0 (cos 1, sin 0), so the kernels rotate whole heads as always. `identity` is a
    rotary of all zero frequencies (layers without rotary).

    The first TABLE_POSITIONS positions' values are kept in a table, grown as positions are
    first seen: a decode step then takes its rows' values in one gather, where computing them
    took ~10 small ops (~75 us a step, per base)."""

    TABLE_POSITIONS = 4096

    def __init__(
        self,
        head_dim: int,
        theta: float,
        scaling_factor: float = 1.0,
        *,
        freq_factors: tuple[float, ...] | None = None,
        rope_dim: int | None = None,
        attention_factor: float = 1.0,
        identity: bool = False,
    ) -> None:
        rope_dim = rope_dim or head_dim
        cpu = torch.device("cpu")  # networks are built under torch.device("meta")
        exponent = torch.arange(0, rope_dim, 2, dtype=torch.float32, device=cpu) / rope_dim
        inv_freq = 1.0 / (theta**exponent) / scaling_factor
        if freq_factors is not None:
            inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float32, device=cpu)
        if identity:
            inv_freq = torch.zeros_like(inv_freq)
        padding = torch.zeros((head_dim - rope_dim) // 2, dtype=torch.float32, device=cpu)
        self.inv_freq = torch.cat((inv_freq, padding))
        self.attention_factor = attention_factor  # scales the rotated dimensions only
        self.rotated = rope_dim // 2
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin [P, head_dim]

    def _compute(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq.to(positions.device)[None]
        cos = freqs.cos()
        sin = freqs.sin()
        if self.attention_factor != 1.0:
            cos[:, : self.rotated] *= self.attention_factor
            sin[:, : self.rotated] *= self.attention_factor
        return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and a signed sin, [T, 1, head_dim] each: see `apply_rotary_`."""
        table = self._table_for(positions) if positions.numel() else None
        if table is None:
            cos, sin = self._compute(positions)
        else:
            cos, sin = (values.index_select(0, positions) for values in table)
        return cos[:, None, :].to(dtype), sin[:, None, :].to(dtype)

    def cos_sin_sections(
        self, positions: torch.Tensor, sections: tuple[int, ...], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """M-RoPE's cos and signed sin from [3, T] positions (temporal, height, width):
        frequency pair i rotates by the position of the axis whose section holds it, the
        sections taken in turn over the half head (transformers' mrope_section; a section
        past the third takes the axes again from the first)."""
        axes = [self.cos_sin(axis, dtype) for axis in positions]
        axis_of_pair = torch.cat(
            [torch.full((size,), i % 3, dtype=torch.long) for i, size in enumerate(sections)]
        )
        axis_of_dim = torch.cat((axis_of_pair, axis_of_pair)).to(positions.device)
        picked = []
        for part in (0, 1):  # cos, then sin
            stacked = torch.stack([values[part] for values in axes])  # [3, T, 1, D]
            index = axis_of_dim.view(1, 1, 1, -1).expand(1, *stacked.shape[1:])
            picked.append(stacked.gather(0, index)[0])
        return picked[0], picked[1]

    def _table_for(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The table on positions' device, covering them (grown by doubling), or None past
        TABLE_POSITIONS."""
        needed = int(positions.max()) + 1
        if needed > self.TABLE_POSITIONS:
            return None
        table = self._table
        if table is None or table[0].shape[0] < needed or table[0].device != positions.device:
            size = min(self.TABLE_POSITIONS, max(256, 1 << (needed - 1).bit_length()))
            table = self._compute(torch.arange(size, device=positions.device))
            self._table = table
        return table


def partial_rotary_rows(num_heads: int, head_dim: int, rope_dim: int) -> torch.Tensor:
    """The row order of a q or k weight that makes partial rotary a whole-head one (see
    Rotary): per head, the rotated pairs (i, i + rope_dim / 2) move to (i, i + head_dim / 2),
    the dimensions left as they are fill the rest of each half. Scores are unchanged, since q
    and k are reordered alike and values not at all."""
    half, rot = head_dim // 2, rope_dim // 2
    rest = half - rot
    within = list(range(rot)) + [rope_dim + i for i in range(rest)]
    within += [rot + i for i in range(rot)] + [rope_dim + rest + i for i in range(rest)]
    order = torch.tensor(within)
    return torch.cat([head * head_dim + order for head in range(num_heads)])


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] in place: x * cos + rotate_half(x) * sin, where
    rotate_half(x) = (-x2, x1) is roll(x, half) = (x2, x1) times the signed sin (-sin, sin)."""
    rotated = x.roll(x.shape[-1] // 2, dims=-1).mul_(sin)
    return x.mul_(cos).add_(rotated)


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        # The checkpoint's own modules; a loaded network replaces gate and up by one fused
        # linear (models/loading/weights.py).
        self.gate_proj: nn.Module | None = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj: nn.Module | None = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj: nn.Module = nn.Linear(intermediate, hidden, bias=False)
        self.gate_up_proj: nn.Module | None = None
        self.intermediate = intermediate
        self.act = act
        self.native_act = native.ACTIVATIONS.get(act.__name__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate_up = self.gate_up_proj(x)
            kernels = native.kernels()
            if kernels is not None and self.native_act is not None and native.readable(gate_up):
                return self.down_proj(kernels.gated_activation(gate_up, self.native_act))
            gate, up = gate_up.split(self.intermediate, dim=-1)
            return self.down_proj(self.act(gate).mul_(up))
        assert self.gate_proj is not None and self.up_proj is not None
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class Attention(nn.Module):
    """Grouped-query attention over the paged KV cache, one SDPA call for the whole batch."""

    def __init__(
        self,
        *,
        layer: int,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        bias: bool,
        qk_norm_eps: float | None,
        scale: float | None = None,
        window: int | None = None,
        softcap: float | None = None,
    ) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
        self.window = window  # sliding-window attention over this many positions
        self.softcap = softcap  # scores squashed by softcap * tanh(score / softcap) (Gemma 2)
        # The checkpoint's own modules; a loaded network replaces q, k and v by one fused
        # linear (models/loading/weights.py).
        self.q_proj: nn.Module | None = nn.Linear(hidden, num_heads * head_dim, bias=bias)
        self.k_proj: nn.Module | None = nn.Linear(hidden, num_kv_heads * head_dim, bias=bias)
        self.v_proj: nn.Module | None = nn.Linear(hidden, num_kv_heads * head_dim, bias=bias)
        self.o_proj: nn.Module = nn.Linear(num_heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.qkv_proj: nn.Module | None = None
        # q_norm and k_norm weights expanded per head, [num_heads + num_kv_heads, head_dim]:
        # one norm call for q and k together (set by models/loading/weights.py).
        self.qk_norm_weight: torch.Tensor | None = None

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        kv: KVCache,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The attention's output for each token of x, or for the tokens `keep` lists (every
        token's keys and values are stored either way): a prompt's last layer projects only
        the tokens whose logits are wanted."""
        out = self._attend(x, rope, batch, kv)
        return self.o_proj(out if keep is None else out[keep])

    def _attend(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        kv: KVCache,
    ) -> torch.Tensor:
        """Every token's attention output before the output projection: [tokens, heads D]."""
        num_tokens = x.shape[0]
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        q_size = heads * head_dim
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(x)
        else:
            assert self.q_proj is not None and self.k_proj is not None and self.v_proj is not None
            qkv = torch.cat((self.q_proj(x), self.k_proj(x), self.v_proj(x)), dim=-1)
        # The pool's dtype (PyTorch's quantized kernels return bf16), except over an fp16 CPU
        # pool, which only the native kernels write and read: they compute in fp32, and over an
        # 8-bit pool (models/kv_q8.py), which is read back as fp32. A fresh tensor either way:
        # normed and rotated in place below.
        pool = kv.pools[self.layer]
        q8 = kv_q8.is_q8(pool)
        computed = torch.float32 if pool.dtype == torch.float16 or q8 else pool.dtype
        qkv = qkv.to(computed)
        rows, max_q = batch.query_index.shape
        kernels = native.kernels()
        context = batch.token_blocks.shape[1] * kv.block_size  # the longest row's, padded
        native_cache = (
            kernels is not None
            and self.native_ready()
            and native.cache_readable(pool)
            and not batch.bidirectional
        )
        tiles = native_cache and not q8 and kernels is not None
        if tiles and kernels is not None and self._tiles_prompt(kernels, batch, max_q):
            # A prompt's tokens before its last: their queries tiled against each block of keys
            # (a sliding window's alone), any context; the step's other rows attend as
            # paged_attention's. Not over an 8-bit pool, which the tiled kernel does not read:
            # its prompts attend natively up to NATIVE_PROMPT_CONTEXT, through SDPA beyond.
            assert batch.prompt_rows is not None
            # A long prompt's bf16 rows attend on AMX tiles (models/kernels/bf16_attention.py)
            # once the kernel has normed, rotated and stored them.
            bf16_rows = batch.coarse_rows if batch.coarse_bf16 and not self.softcap else None
            tiled = batch.prompt_rows
            if bf16_rows is not None:
                tiled = bf16_attention.marks(batch.prompt_rows, bf16_rows)
            qkv = qkv.contiguous()
            out = kernels.prompt_attention(
                qkv,
                heads,
                kv_heads,
                self._native_qk_norm(),
                rope,
                pool,
                batch.slot_mapping,
                batch.token_blocks,
                kv.block_size,
                batch.positions,
                tiled,
                self.window or 0,
                self.scale,
                self.softcap or 0.0,
            )
            if bf16_rows is not None:
                bf16_attention.attend_runs(
                    qkv,
                    out,
                    bf16_rows,
                    heads,
                    kv_heads,
                    head_dim,
                    pool,
                    batch.positions,
                    batch.token_blocks,
                    kv.block_size,
                    self.window or 0,
                    self.scale,
                    batch.shared,
                )
            return out
        if native_cache and (max_q == 1 or context <= NATIVE_PROMPT_CONTEXT):
            assert kernels is not None
            # Every token, a decode row's or a prompt's, attends over its own row's paged keys
            # up to its position, read in place: no gathered context, no mask, and (unlike SDPA
            # with a mask) no work above the causal diagonal.
            out = kernels.paged_attention(
                qkv.contiguous(),
                heads,
                kv_heads,
                self._native_qk_norm(),
                rope,
                pool,
                batch.slot_mapping,
                batch.token_blocks,
                kv.block_size,
                batch.positions,
                self.window or 0,
                self.scale,
                self.softcap or 0.0,
            )
            return out
        qk = qkv[:, : q_size + kv_heads * head_dim].view(num_tokens, -1, head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            weight = self.qk_norm_weight
            if weight is None:
                weight = self.expanded_qk_norm_weight()
            torch.mul(torch.rms_norm(qk, (head_dim,), None, self.q_norm.eps), weight, out=qk)
        apply_rotary_(qk, *rope)
        # Rotated keys and the values sit side by side in qkv: one write into the pool.
        new_kv = qkv[:, q_size:].view(num_tokens, 2, kv_heads, head_dim)
        gathered = kv.blocks(self.layer)
        if q8:
            pool.index_copy_(0, batch.slot_mapping, kv_q8.quantize(new_kv))
            gathered = gathered.index_select(0, batch.kv_blocks.view(-1))
            slots = gathered.view(rows, -1, 2, kv_heads, kv_q8_layout.slot_width(head_dim))
            gathered = kv_q8.dequantize(slots, head_dim)
        else:
            pool.index_copy_(0, batch.slot_mapping, new_kv.to(pool.dtype))
            gathered = gathered.index_select(0, batch.kv_blocks.view(-1)).to(qkv.dtype)
            gathered = gathered.view(rows, -1, 2, kv_heads, head_dim)
        keys = gathered[:, :, 0].transpose(1, 2)  # [R, Hkv, max_kv, D]
        values = gathered[:, :, 1].transpose(1, 2)
        mask = batch.sliding_mask if self.window is not None else batch.attn_mask

        q = qkv[:, :q_size]
        if self.softcap is not None:
            return self._capped_attention(q, keys, values, mask, batch, num_tokens)
        if batch.dense and max_q == 1:
            # One query per row: the query heads of a KV head share its keys, so grouped
            # attention is plain SDPA over [R, Hkv, group, D] (no repeated keys and values).
            queries = q.view(rows, kv_heads, heads // kv_heads, head_dim)
            out = F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=mask, scale=self.scale
            )
            return out.reshape(rows, q_size)
        if batch.dense:
            queries = q.view(rows, max_q, heads, head_dim).transpose(1, 2)
        else:
            queries = q.view(num_tokens, heads, head_dim)[batch.query_index].transpose(1, 2)
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=True
        )
        out = out.transpose(1, 2).reshape(rows * max_q, q_size)
        return out if batch.dense else out[batch.output_index]

    def _tiles_prompt(self, kernels: native.Kernels, batch: ForwardBatch, max_q: int) -> bool:
        """Whether this step's prompt rows attend tiled (mh_prompt_attention): a head
        grouping the kernel takes."""
        return (
            max_q > 1
            and batch.prompt_rows is not None
            and batch.prompt_rows.shape[0] == batch.positions.shape[0]
            and self.head_dim % 16 == 0
            and kernels.prompt_attention_takes(self.num_heads, self.num_kv_heads)
        )

    def _capped_attention(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor | None,
        batch: ForwardBatch,
        num_tokens: int,
    ) -> torch.Tensor:
        """Attention with soft-capped scores, written out (SDPA has no cap): [tokens, H D]."""
        rows, max_q = batch.query_index.shape
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        if batch.dense:
            queries = q.view(rows, max_q, heads, head_dim).transpose(1, 2)
        else:
            queries = q.view(num_tokens, heads, head_dim)[batch.query_index].transpose(1, 2)
        group = heads // kv_heads
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        scores = queries @ keys.transpose(-1, -2) * self.scale
        assert self.softcap is not None
        scores = torch.tanh(scores / self.softcap) * self.softcap
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ values  # [R, H, max_q, D]
        out = out.transpose(1, 2).reshape(rows * max_q, heads * head_dim)
        return out if batch.dense else out[batch.output_index]

    def _native_qk_norm(self) -> tuple[torch.Tensor, float] | None:
        if self.q_norm is None:
            return None
        assert self.qk_norm_weight is not None  # native_ready() said so
        return self.qk_norm_weight, self.q_norm.eps

    def native_ready(self) -> bool:
        """Whether the native attention can run this layer (over a pool it reads):
        head dimensions in whole vectors, q/k norm weights prepared."""
        return self.head_dim % 16 == 0 and (self.q_norm is None or self.qk_norm_weight is not None)

    def expanded_qk_norm_weight(self) -> torch.Tensor:
        assert self.q_norm is not None and self.k_norm is not None
        head_dim = self.head_dim
        return torch.cat(
            (
                self.q_norm.weight.expand(self.num_heads, head_dim),
                self.k_norm.weight.expand(self.num_kv_heads, head_dim),
            )
        )
