"""A decode step through every decoder layer in one native call (`mh_decode_layers`).

A step of generated tokens only (one query per row) spends most of its Python time calling
~15 modules a layer: SmolLM2 has 30 layers of width 576, where each call costs more than its
arithmetic. When every layer of a prepared network runs on the native kernels (quantized
linears, fp32 norms, a gated MLP the kernels know), `FusedDecode` describes the layers once
(pointers into the modules' packed weights, no copies) and runs such steps in C++; the same
kernels, in the same order, as the module-by-module path, so results do not change. The
descriptions point into the network's tensors: they must not move (`.to()`) after the first
decode step.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from modelhost.models.batch import ForwardBatch, KVCache
from modelhost.models.kernels import native
from modelhost.models.kernels.packed import QuantLinear
from modelhost.models.kernels.structs import NativeLayer, NativeLinear, NativeStep, QLinearDesc
from modelhost.models.networks.layers import GatedMLP

if TYPE_CHECKING:
    from modelhost.models.networks.decoder import DecoderBlock, DecoderLM

ROPE_KINDS = ("global", "local", "none")  # NativeLayer.rope's values, in order
# The host modules of a layer whose LoRA updates NativeStep.lora describes, in its order.
LORA_HOSTS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


class FusedDecode:
    """The native description of a network's layers, built by `for_network`."""

    def __init__(self, kernels: native.Kernels, layers: ctypes.Array, width: int) -> None:
        self.kernels = kernels
        self.layers = layers
        self.width = width
        self._pools: tuple[KVCache, ctypes.Array] | None = None
        # The step's LoRA updates of its rows: NativeLora [layers * 4] (LORA_HOSTS), made when
        # a step runs here; set by models/adapters/row_adapters.py around its steps.
        self.lora: Callable[[], ctypes.Array] | None = None

    @classmethod
    def for_network(cls, network: DecoderLM) -> FusedDecode | None:
        """None unless every layer can run natively (see the module's docstring)."""
        kernels = native.kernels()
        if kernels is None:
            return None
        config = network.config
        specs = [
            _layer(block, config.rope_kind(index), config.residual_multiplier)
            for index, block in enumerate(network.model.blocks())
        ]
        described = [spec for spec in specs if spec is not None]
        if len(described) != len(specs):
            return None
        layers = (NativeLayer * len(described))(*described)
        return cls(kernels, layers, network.config.hidden_size)

    def can_run(self, batch: ForwardBatch, kv: KVCache) -> bool:
        """Whether this step is one the fused path computes: one token a row (generated, or a
        prompt's only one), over a CPU pool the kernels read (fp32, fp16 or q8), all of it at
        16 bits (a step with coarse prompt rows takes the module path, which rounds them to
        8)."""
        return (
            batch.dense
            and batch.coarse_rows is None
            and batch.query_index.shape[1] == 1
            and not batch.bidirectional
            and native.cache_readable(kv.pools[0])
        )

    def run(
        self,
        hidden: torch.Tensor,
        ropes: dict[str, tuple[torch.Tensor, torch.Tensor]],
        batch: ForwardBatch,
        kv: KVCache,
        before_layers: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """The layers' output for hidden [rows, width] (updated in place). `before_layers` runs
        last before the native call, which holds no GIL."""
        hidden = hidden.contiguous()
        some = next(iter(ropes.values()))  # for the kinds no layer uses
        tables = [ropes.get(kind, some) for kind in ROPE_KINDS]
        step = NativeStep(
            rows=hidden.shape[0],
            width=self.width,
            cos=(ctypes.c_void_p * 3)(*[cos.data_ptr() for cos, _ in tables]),
            sin=(ctypes.c_void_p * 3)(*[sin.data_ptr() for _, sin in tables]),
            pools=ctypes.addressof(self._pool_pointers(kv)),
            pool_kind=native.pool_kind(kv.pools[0]),
            slots=batch.slot_mapping.data_ptr(),
            blocks=batch.kv_blocks.data_ptr(),
            positions=batch.positions.data_ptr(),
            blocks_per_row=batch.kv_blocks.shape[1],
            block_size=kv.block_size,
            threads=self.kernels.threads,
        )
        lora = self.lora() if self.lora is not None else None  # held until the call returns
        if lora is not None:
            step.lora = ctypes.addressof(lora)
        if before_layers is not None:
            before_layers()
        self.kernels.decode_layers(hidden, self.layers, step)
        return hidden

    def _pool_pointers(self, kv: KVCache) -> ctypes.Array:
        if self._pools is None or self._pools[0] is not kv:
            pointers = (ctypes.c_void_p * len(kv.pools))(*[pool.data_ptr() for pool in kv.pools])
            self._pools = (kv, pointers)
        return self._pools[1]


def _linear(module: nn.Module | None) -> NativeLinear | None:
    if not isinstance(module, QuantLinear) or len(module.parts) > 3:
        return None
    if module.in_features != module.padded:  # the step's buffers hold unpadded rows
        return None
    try:
        bias = _fp32(module.bias)
    except ValueError:
        return None
    parts = [part.desc for part in module.parts]
    return NativeLinear(
        parts=(QLinearDesc * 3)(*parts),
        count=len(parts),
        out=module.out_features,
        bias=bias,
    )


def _fp32(tensor: torch.Tensor | None) -> int | None:
    """The address of a tensor the kernels read as it is (None for None); ValueError if not."""
    if tensor is None:
        return None
    if not native.readable(tensor):
        raise ValueError
    return tensor.data_ptr()


def _layer(block: DecoderBlock, rope: str, residual_scale: float) -> NativeLayer | None:
    attn, mlp = block.self_attn, block.mlp
    moe = None
    if isinstance(mlp, GatedMLP):
        if mlp.native_act is None:
            return None
        mlp_linears = [_linear(mlp.gate_up_proj), _linear(mlp.down_proj)]
    else:  # a mixture of experts (models/networks/moe.py): mh_moe, in place of gate_up and down
        experts = mlp.native_experts()
        if experts is None:
            return None
        moe = ctypes.addressof(experts.description)
        mlp_linears = [NativeLinear(), NativeLinear()]
    linears = [_linear(attn.qkv_proj), _linear(attn.o_proj), *mlp_linears]
    if any(spec is None for spec in linears):
        return None
    if not attn.native_ready():
        return None
    modules = block.native_norms()  # input, attention-out, MLP-in, MLP-out
    first = modules[0]
    if first is None or any(n is not None and n.eps != first.eps for n in modules):
        return None
    eps = first.eps
    try:
        pointers = [_fp32(n.weight if n is not None else None) for n in modules]
        qk_norm = _fp32(attn.qk_norm_weight)
    except ValueError:
        return None
    qkv, o, gate_up, down = cast(list[NativeLinear], linears)
    return NativeLayer(
        qkv=qkv,
        o=o,
        gate_up=gate_up,
        down=down,
        input_norm=pointers[0],
        attention_out_norm=pointers[1],
        mlp_in_norm=pointers[2],
        mlp_out_norm=pointers[3],
        qk_norm=qk_norm,
        eps=eps,
        qk_eps=attn.q_norm.eps if attn.q_norm is not None else 0.0,
        scale=attn.scale,
        softcap=attn.softcap or 0.0,
        residual_scale=residual_scale,
        act=mlp.native_act if isinstance(mlp, GatedMLP) else 0,
        rope=ROPE_KINDS.index(rope),
        heads=attn.num_heads,
        kv_heads=attn.num_kv_heads,
        dim=attn.head_dim,
        window=attn.window or 0,
        moe=moe,
    )
