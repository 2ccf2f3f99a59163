"""Linears prepared for CPU inference: fused projections, weight-only int8 / int4 kernels.

After loading, `prepare_for_inference` fuses each attention's q/k/v projections into one
matmul and each MLP's gate/up into another, and swaps every linear (LM head included) for one
of three implementations:

- `DenseLinear`: fp32, the weight stored transposed ([in, out]). MKL's small-M sgemm reads a
  row-major [out, in] weight much slower than its transpose (2-3x at 8 rows on these CPUs).
- `Int8Linear`: per-output-channel symmetric int8.
- `Int4Linear`: asymmetric int4 in groups of 32 along the input. GGUF's Q4_0/Q4_1/Q4_K
  tensors already hold at most 16 levels per 32 weights, so for those the int4 form
  reproduces the dequantized weights exactly; `exact_int4` finds each group's grid.

The quantized linears run the native kernels (models/native.py: activations rounded to 16
bits per row, integer dot products with AVX-512 VNNI or AVX2). Where those cannot run they fall
back to PyTorch's (`aten._weight_int4pack_mm_for_cpu`, `aten._weight_int8pack_mm`), which are
vectorised only for bf16 activations here, so the linear then rounds its input to bf16 and
returns bf16 (and keeps bf16 scales); the residual stream, norms, attention and softmax stay
fp32 either way.

The quantized LM head is a `RefinedHead`: a coarse pass ranks the vocabulary (grouped int4
weights and int8 dot products with the native kernels, `Int4RankingHead`; else the mode's
int4/int8 linear) and its best candidates are recomputed in fp32. Prompt tokens skip the
kernels: each layer linear also holds its dequantized weight in fp32 for them
(`token_roles`).

Modes (`MODELHOST_QUANTIZE` or `load_model(quantize=...)`):
  none   fp32 everywhere (bit-for-bit the reference maths; the parity tests use it)
  int8   int8 for every linear and the LM head
  auto   int4 where a weight already is 4-bit in groups of 32 (lossless), int8 elsewhere;
         a ranked LM head whose best candidates are recomputed in fp32 (`RefinedHead`)
  int4   int4 for every linear (lossy where the GGUF had more bits), a ranked LM head
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from modelhost.models import native

MODES = ("none", "int8", "auto", "int4")
GROUP = native.GROUP
_BF16 = torch.bfloat16


# MKL's fp32 sgemm computes prompt tokens (hundreds of rows a step) about twice as fast as
# either quantized kernel, which is tuned for a few rows (SmolLM2 prefill, 1 thread: 408 tok/s
# against 203). So every layer linear also keeps its dequantized weight in fp32, transposed
# (memory traded for prefill speed), and a step's prompt tokens go through it while generated
# tokens take the quantized kernel. The choice is by a token's role, never by how many tokens
# share its step, so a row's greedy output does not depend on its neighbours (batch invariance:
# tests/engine/test_engine.py).
_roles = threading.local()


@contextmanager
def token_roles(prompt: torch.Tensor | None, generated: torch.Tensor | None) -> Iterator[None]:
    """Within this block, layer linears see a step whose tokens at `prompt` are prompt tokens
    and those at `generated` generated ones (None: no token of that role)."""
    _roles.current = (prompt, generated)
    try:
        yield
    finally:
        _roles.current = None


def _prompt_matmul(
    x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    y = torch.matmul(x.float(), weight_t)
    return y if bias is None else y.add_(bias)


class _QuantizedLinear(nn.Module):
    """A quantized kernel for generated tokens, fp32 sgemm for prompt tokens (see above)."""

    prompt_weight_t: torch.Tensor | None
    bias: torch.Tensor | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        prompt, generated = getattr(_roles, "current", None) or (None, None)
        if prompt is None or self.prompt_weight_t is None:
            return self.quantized(x)
        if generated is None:
            return _prompt_matmul(x, self.prompt_weight_t, self.bias)
        from_prompt = _prompt_matmul(x[prompt], self.prompt_weight_t, self.bias)
        y = x.new_empty((x.shape[0], from_prompt.shape[-1]), dtype=from_prompt.dtype)
        y.index_copy_(0, prompt, from_prompt)
        return y.index_copy_(0, generated, self.quantized(x[generated]).to(y.dtype))

    def quantized(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class DenseLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("weight_t", weight.t().contiguous())
        self.register_buffer("bias", bias)
        self.out_features = weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return torch.matmul(x, self.weight_t)
        return torch.addmm(self.bias, x, self.weight_t)


class Int8Linear(_QuantizedLinear):
    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, *, prompt_fp32: bool = True
    ) -> None:
        super().__init__()
        weight = weight.float()
        scales = (weight.abs().amax(dim=1) / 127.0).clamp_(min=1e-12)
        q = torch.round(weight / scales[:, None]).clamp_(-127, 127).to(torch.int8)
        self.native = native.kernels()
        if self.native is None:
            self.register_buffer("qweight", q)
            self.register_buffer("scales", scales.to(_BF16))  # PyTorch's kernel takes bf16
            scales = self.scales.float()  # the fp32 copy below: the same rounded scales
        else:
            self.register_buffer("qweight", native.pack_int8(q))
            self.register_buffer("scales", scales)
        self.register_buffer("bias", bias)
        restored = q.float() * scales[:, None]
        prompt_weight_t = restored.t().contiguous() if prompt_fp32 else None
        self.register_buffer("prompt_weight_t", prompt_weight_t)
        self.out_features, self.in_features = weight.shape

    def quantized(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if self.native is not None:
            y = self.native.int8_matmul(x, self.qweight, self.scales)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x.to(_BF16), self.qweight, self.scales)
        y = y.view(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class Int4Linear(_QuantizedLinear):
    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        search: bool = True,
        prompt_fp32: bool = True,
    ) -> None:
        super().__init__()
        q, scales, mins = quantize_int4(weight, search=search)
        out_features, in_features = weight.shape
        self.native = native.kernels()
        if self.native is None:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.view(out_features, -1), 1)
            # The kernel computes (q - 8) * scale + zero; store zero = min + 8 * scale.
            zeros = mins + 8 * scales
            scales_zeros = torch.stack((scales, zeros), dim=-1).transpose(0, 1).to(_BF16)
            self.register_buffer("packed", packed)
            self.register_buffer("scales_zeros", scales_zeros.contiguous())  # [in/32, out, 2]
            scale, zero = scales_zeros.float().unbind(-1)
            scales, mins = scale.t(), zero.t() - 8 * scale.t()
        else:
            scales, mins = native.int4_params(scales, mins)
            nibbles, params = native.pack_int4(q, scales, mins)
            self.register_buffer("nibbles", nibbles)
            self.register_buffer("group_params", params)
        self.register_buffer("bias", bias)
        prompt_weight_t = None
        if prompt_fp32:
            restored = q.float() * scales[..., None] + mins[..., None]
            prompt_weight_t = restored.reshape(out_features, in_features).t().contiguous()
        self.register_buffer("prompt_weight_t", prompt_weight_t)
        self.out_features, self.in_features = out_features, in_features

    def quantized(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if self.native is not None:
            y = self.native.int4_matmul(x, self.nibbles, self.group_params, self.out_features)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.to(_BF16), self.packed, GROUP, self.scales_zeros
            )
        y = y.view(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class Int4RankingHead(nn.Module):
    """A head's approximate logits for a `RefinedHead` to rank with (`mh_int4_rank`): each
    weight row in 16 groups of asymmetric int4 with an fp16 scale and min each, inputs rounded
    to int8 with one scale per row, multiplied by VNNI 128 products a 64-byte load. Gemma 3's
    262,144-token head is half of its decode step, and reading it is what that half costs:
    these are 101 MB, against 170 for int8 with a scale per token.

    On the real hidden states of both embedded models, the fp32 top 40 lies inside this
    ranking's top 256 every time, hence `TOP` candidates. The tail keeps the approximation,
    which moves perplexity: symmetric groups (no mins) cost SmolLM2 +2.6%; 32 groups with mins
    came closer to fp32 still but made 8-row steps slower (two accumulators a row)."""

    TOP = 256
    GROUPS = 16  # one per lane of a 512-bit int32 accumulator (mh_int4_rank)

    def __init__(self, weight: torch.Tensor, kernels: native.Kernels) -> None:
        super().__init__()
        self.group = -(-weight.shape[1] // self.GROUPS)
        # In slices of rows: the temporaries of a whole 262,144-row head would take gigabytes.
        packed = [self._pack(rows) for rows in weight.split(16384)]
        self.register_buffer("nibbles", torch.cat([nibbles for nibbles, _ in packed]))
        self.register_buffer("params", torch.cat([params for _, params in packed]))
        self.kernels = kernels
        self.out_features = weight.shape[0]

    def _pack(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, width = weight.shape
        lane = -(-self.group // 8) * 8  # a group's inputs, padded to whole 64-byte loads
        padding = self.GROUPS * self.group - width
        grouped = torch.nn.functional.pad(weight.float(), (0, padding)).view(out, self.GROUPS, -1)
        low = grouped.amin(dim=2).half()
        # The floor keeps fp16 scales normal and nonzero where a group is constant.
        scales = ((grouped.amax(dim=2) - low.float()) / 15).clamp_min(2**-14).half()
        q = (grouped - low.float()[..., None]) / scales.float()[..., None]
        q = torch.nn.functional.pad(
            q.round_().clamp_(0, 15).to(torch.uint8), (0, lane - self.group)
        )
        # [out, group l, load j, half, k] -> [out, j, l, half, k]: byte 4l + k of load j holds
        # input 8j + k of group l (low nibble) and 8j + 4 + k (high).
        q = q.view(out, self.GROUPS, lane // 8, 2, 4).permute(0, 2, 1, 3, 4)
        nibbles = q[..., 0, :] | (q[..., 1, :] << 4)
        return nibbles.reshape(out, -1).contiguous(), torch.cat([scales, low], dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rank(x)[0]

    def rank(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits and the largest of each 16 of them (Kernels.int4_rank)."""
        return self.kernels.int4_rank(
            x.reshape(-1, x.shape[-1]), self.nibbles, self.params, self.group
        )


class RefinedHead(nn.Module):
    """An LM head whose approximate logits (a quantized kernel, with rounded activations) are
    recomputed exactly in fp32 for the `top` best tokens of each row.

    Greedy picks, top-k/top-p cut-offs and logprobs of the likely tokens are then those of
    the fp32 weight; the tail keeps the approximation. `weight` is the fp32 [vocab, hidden]
    matrix, usually the (tied) embedding, so it costs no extra memory.
    """

    def __init__(self, approx: nn.Module, weight: torch.Tensor, top: int = 128) -> None:
        super().__init__()
        self.approx = approx
        self.weight = weight  # shared with the embedding: a plain attribute, not a buffer
        self.top = top

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        maxima = None
        if isinstance(self.approx, Int4RankingHead):
            logits, maxima = self.approx.rank(x)
        else:
            logits = self.approx(x).float()
        if x.shape[0] == 0:
            return logits
        kernels = native.kernels()
        if kernels is not None and native.readable(logits):
            index = kernels.top_candidates(logits, self.top, maxima)  # [S, top]
            x = x.float().contiguous()
            if native.readable(self.weight):
                kernels.refine(x, self.weight, index, logits)
                return logits
        else:
            index = logits.topk(self.top, dim=-1, sorted=False).indices
        rows = self.weight.index_select(0, index.view(-1)).view(*index.shape, -1)
        exact = torch.bmm(rows, x.float().unsqueeze(-1)).squeeze(-1)
        return logits.scatter_(1, index, exact)


def _grouped(weight: torch.Tensor) -> torch.Tensor:
    out_features, in_features = weight.shape
    return weight.float().reshape(out_features, in_features // GROUP, GROUP)


def quantize_int4(
    weight: torch.Tensor, *, search: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [out, in/32, 32] int32 in 0..15, scales and mins [out, in/32]: w ~ q * scale + min.

    With `search`, each group's step is the finest d = (max - min) / j, j <= 15, that puts every
    weight on the grid (GGUF's 4-bit groups; Q4_1 spans all 16 levels, so one pass settles
    them); groups with no such d (more than 4 bits), and all groups without `search`, use
    j = 15: a plain min/max quantization.
    """
    groups = _grouped(weight)
    low = groups.amin(dim=-1)
    span = groups.amax(dim=-1) - low
    steps = span / 15
    offsets = groups - low[..., None]
    if search:
        flat_offsets = offsets.view(-1, GROUP)
        flat_span = span.view(-1)
        flat_steps = steps.view(-1)  # written through: a view of `steps`
        pending = torch.arange(flat_span.numel())
        for levels in range(15, 0, -1):
            step = flat_span[pending] / levels
            safe = torch.where(step > 0, step, torch.ones_like(step))
            ratio = flat_offsets[pending] / safe[:, None]
            on_grid = ((ratio - ratio.round()).abs() < 1e-2).all(dim=-1)
            flat_steps[pending[on_grid]] = step[on_grid]
            pending = pending[~on_grid]
            if pending.numel() == 0:
                break
    safe = torch.where(steps > 0, steps, torch.ones_like(steps))
    q = torch.round(offsets / safe[..., None]).clamp_(0, 15).to(torch.int32)
    return q, steps, low


def exact_int4(weight: torch.Tensor, sample_rows: int | None = None) -> bool:
    """Whether every group of 32 weights (of the first `sample_rows` rows, if given) sits on a
    grid of at most 16 levels."""
    if weight.shape[1] % GROUP:
        return False
    if sample_rows is not None:
        weight = weight[:sample_rows]
    q, steps, low = quantize_int4(weight)
    restored = q.float() * steps[..., None] + low[..., None]
    groups = _grouped(weight)
    tolerance = 1e-3 * steps[..., None].clamp(min=1e-12)
    return bool(((restored - groups).abs() <= tolerance + 1e-6 * groups.abs()).all())


def make_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, kind: str, *, search: bool = True
) -> nn.Module:
    weight = weight.detach()
    bias = None if bias is None else bias.detach().float().clone()
    if kind == "int4" and weight.shape[1] % GROUP == 0 and weight.shape[0] % 16 == 0:
        return Int4Linear(weight, bias, search=search, prompt_fp32=search)
    if kind in ("int4", "int8"):
        return Int8Linear(weight, bias, prompt_fp32=search)
    return DenseLinear(weight.float(), bias)


def _kind(weight: torch.Tensor, mode: str, *, head: bool) -> str:
    if mode == "none":
        return "fp32"
    if mode == "int8":
        return "int8"
    if mode == "int4" or head:
        # A RefinedHead recomputes the best candidates in fp32, so a coarse pass only has to
        # rank them: int4 (2-3x faster than the int8 linear) without the native ranking.
        return "int4"
    # auto: a sample of rows decides (a GGUF tensor has one quantization type throughout).
    return "int4" if exact_int4(weight, sample_rows=64) else "int8"


def _fused(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    weight = torch.cat([linear.weight.detach() for linear in linears])
    if all(linear.bias is None for linear in linears):
        return weight, None
    biases = [
        linear.bias.detach()
        if linear.bias is not None
        else torch.zeros(linear.out_features, dtype=weight.dtype)
        for linear in linears
    ]
    return weight, torch.cat(biases)


@torch.no_grad()
def prepare_for_inference(network: nn.Module, mode: str) -> nn.Module:
    """Fuse and swap the linears of a loaded CPU `DecoderLM` in place; returns it."""
    if mode not in MODES:
        raise ValueError(f"unknown quantization mode '{mode}' (one of {', '.join(MODES)})")
    for layer in network.model.layers:
        attn = layer.self_attn
        weight, bias = _fused([attn.q_proj, attn.k_proj, attn.v_proj])
        attn.qkv_proj = make_linear(weight, bias, _kind(weight, mode, head=False))
        attn.q_proj = attn.k_proj = attn.v_proj = None
        if attn.q_norm is not None and attn.k_norm is not None:
            attn.qk_norm_weight = attn.expanded_qk_norm_weight().detach().float().contiguous()
        attn.o_proj = _swap(attn.o_proj, mode)
        mlp = layer.mlp
        weight, _ = _fused([mlp.gate_proj, mlp.up_proj])
        mlp.gate_up_proj = make_linear(weight, None, _kind(weight, mode, head=False))
        mlp.gate_proj = mlp.up_proj = None
        mlp.down_proj = _swap(mlp.down_proj, mode)
    head = network.lm_head.weight.detach()
    kind = _kind(head, mode, head=True)
    if kind == "fp32":
        network.lm_head = make_linear(head, None, kind)
        return network
    kernels = native.kernels()
    if kernels is not None:
        ranking = Int4RankingHead(head, kernels)
        network.lm_head = RefinedHead(ranking, head.float(), ranking.TOP)
        return network
    # search=False: refined anyway, and no fp32 prompt copy (only sampled rows reach it).
    approx = make_linear(head, None, kind, search=False)
    network.lm_head = RefinedHead(approx, head.float())
    return network


def _swap(linear: nn.Linear, mode: str) -> nn.Module:
    weight = linear.weight.detach()
    return make_linear(weight, linear.bias, _kind(weight, mode, head=False))


def describe(network: nn.Module) -> dict[str, int]:
    """How many linears of each kind the network holds (for logs and benchmarks)."""
    counts: dict[str, int] = {}
    for module in network.modules():
        name = type(module).__name__
        if name in ("DenseLinear", "Int8Linear", "Int4Linear", "Linear"):
            counts[name] = counts.get(name, 0) + 1
    return counts
