"""A sparse mixture-of-experts MLP (Qwen3-MoE): a router picks each token's top-k experts,
each a SwiGLU MLP, and the token's output is their outputs weighted by the router's
probabilities (renormalised over the chosen k where the config says so).

A step reads each chosen expert's weights once for all the rows that chose it: rows are
grouped by expert, and where every expert is packed for the native kernels one native call
runs them all (`mh_moe_experts`, native_moe.h), so a step costs about the experts it uses,
not all of them.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import nn

from modelhost.models.config import ModelConfig
from modelhost.models.kernels import native
from modelhost.models.kernels.packed import QuantLinear
from modelhost.models.kernels.structs import NativeMoE, QLinearDesc
from modelhost.models.networks.layers import GatedMLP


class SparseMoE(nn.Module):
    """Parameter names follow Hugging Face's per-expert checkpoints: `gate` (the router) and
    `experts.N.{gate,up,down}_proj`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, intermediate = config.hidden_size, config.moe_intermediate_size
        self.gate = nn.Linear(hidden, config.num_experts, bias=False)
        self.experts = nn.ModuleList(
            GatedMLP(hidden, intermediate, F.silu) for _ in range(config.num_experts)
        )
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self._native: NativeExperts | None = None
        self._native_described = False

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's chosen experts' weights (fp32 [rows, k]) and ids (int64 [rows, k]),
        as transformers computes them: softmax over all experts in fp32, then the top k."""
        logits = F.linear(x.to(self.gate.weight.dtype), self.gate.weight)
        probabilities = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probabilities, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        experts = self.native_experts()
        if experts is not None and native.readable(x):
            return experts.kernels.moe(x, experts.description).view(shape)
        weights, ids = self.route(x)
        out = torch.zeros_like(x)
        # Expert by expert in id order, each over the rows that chose it (transformers' order).
        for expert in ids.unique().tolist():
            rows, slot = (ids == expert).nonzero(as_tuple=True)
            y = self.experts[expert](x[rows]) * weights[rows, slot, None].to(x.dtype)
            out.index_add_(0, rows, y.to(out.dtype))
        return out.view(shape)

    def native_experts(self) -> NativeExperts | None:
        """The MLP as the native kernels take it, described on first use (once the weights
        are in); None where the router is not fp32 or some expert is not packed in a form
        they run."""
        if not self._native_described:
            self._native = NativeExperts.describe(self)
            self._native_described = True
        return self._native


class NativeExperts:
    """A SparseMoE for `mh_moe`: pointers to its router's weight and to every expert's fused
    gate/up and down weights (QLinear descriptions, no copies), which must not move."""

    def __init__(
        self, kernels: native.Kernels, gate_up: ctypes.Array, down: ctypes.Array, moe: SparseMoE
    ) -> None:
        self.kernels, self.gate_up, self.down = kernels, gate_up, down  # kept alive
        self.description = NativeMoE(
            router=moe.gate.weight.data_ptr(),
            gate_up=ctypes.addressof(gate_up),
            down=ctypes.addressof(down),
            experts=len(gate_up),
            top_k=moe.top_k,
            norm_topk=int(moe.norm_topk_prob),
            act=native.ACTIVATIONS["silu"],
        )

    @classmethod
    def describe(cls, moe: SparseMoE) -> NativeExperts | None:
        kernels = native.kernels()
        if kernels is None or not native.readable(moe.gate.weight):
            return None
        gate_ups, downs = [], []
        for module in moe.experts:
            assert isinstance(module, GatedMLP)
            gate_up, down = module.gate_up_proj, module.down_proj
            if not isinstance(gate_up, QuantLinear) or not isinstance(down, QuantLinear):
                return None
            if len(gate_up.parts) != 1 or len(down.parts) != 1 or module.native_act is None:
                return None
            if gate_up.bias is not None or down.bias is not None:
                return None
            gate_ups.append(gate_up.parts[0].desc)
            downs.append(down.parts[0].desc)
        array = QLinearDesc * len(gate_ups)
        return cls(kernels, array(*gate_ups), array(*downs), moe)


def sparse_or_dense_mlp(config: ModelConfig, layer: int) -> SparseMoE | GatedMLP:
    """The MLP of a layer: a mixture of experts where the config makes it sparse."""
    if config.is_sparse_layer(layer):
        return SparseMoE(config)
    return GatedMLP(config.hidden_size, config.intermediate_size, F.silu)
