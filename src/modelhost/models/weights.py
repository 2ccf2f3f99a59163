"""Filling a network with a checkpoint's weights, one tensor at a time.

The network is built on the meta device (no memory), then each of its linears is made from the
checkpoint's tensors in the form the mode asks for (models/quant.py): packed in the file's own
quantization for the native kernels, or dense. Tensors are read one at a time from their
source (a GGUF file, safetensors files), so loading holds the model's final form plus one
tensor, never the whole model in fp32.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from modelhost.models import native, packed
from modelhost.models.decoder import DecoderLM
from modelhost.models.packed import PackedEmbedding, PackedWeight, QuantLinear
from modelhost.models.quant import DenseLinear, linear_from_parts, pack_float, target_type


class TensorSource(Protocol):
    """One tensor of a checkpoint, read when asked for."""

    name: str  # our (Hugging Face) parameter name
    shape: tuple[int, ...]  # PyTorch's order: [out, in] for a linear's weight
    type: int  # its GGUF type id (safetensors tensors: F32, F16 or BF16)
    nbytes: int  # bytes in the file

    def dense(self) -> torch.Tensor:
        """The tensor in fp32 (dequantized)."""
        ...

    def packed(self, kernels: native.Kernels) -> PackedWeight:
        """The tensor repacked for the kernels in its own type (a 2-D one)."""
        ...


@dataclass(frozen=True, slots=True)
class WeightPlan:
    """How to hold the weights: `mode` (models/quant.py), and the device and dtype of dense
    tensors."""

    mode: str
    device: torch.device
    dtype: torch.dtype

    @property
    def kernels(self) -> native.Kernels | None:
        """The native kernels where this plan packs weights for them, else None."""
        if self.mode == "none" or self.device.type != "cpu":
            return None
        return native.kernels()


# Called with the fraction of the checkpoint's bytes loaded so far.
Progress = Callable[[float], None]


class UnsupportedTensor(ValueError):
    """A tensor whose type the kernels cannot take (say, an IQ quantization)."""


def fill_network(
    network: DecoderLM,
    sources: Mapping[str, TensorSource],
    plan: WeightPlan,
    progress: Progress | None = None,
) -> None:
    """Gives a meta-device `network` every weight from `sources`, in the plan's forms."""
    loader = _Filler(network, sources, plan, progress)
    loader.fill()


def fill_checkpoint_modules(
    network: DecoderLM, sources: Mapping[str, TensorSource], progress: Progress | None = None
) -> None:
    """Gives a meta-device `network` its checkpoint's tensors as they are named, dense fp32,
    in its own (unfused) modules: what a converter writes back out."""
    total = max(1, sum(source.nbytes for source in sources.values()))
    done = 0
    tied = network.config.tie_word_embeddings
    for name, _ in list(network.named_parameters(remove_duplicate=False)):
        if tied and name == "lm_head.weight":
            continue
        source = sources.get(name)
        if source is None:
            raise ValueError(f"checkpoint lacks the tensor {name}")
        owner, _, attribute = name.rpartition(".")
        setattr(network.get_submodule(owner), attribute, nn.Parameter(source.dense(), False))
        done += source.nbytes
        if progress is not None:
            progress(done / total)
    if tied:
        network.lm_head.weight = network.model.embed_tokens.weight
    network.eval()


class _Filler:
    def __init__(
        self,
        network: DecoderLM,
        sources: Mapping[str, TensorSource],
        plan: WeightPlan,
        progress: Progress | None,
    ) -> None:
        self.network = network
        self.sources = sources
        self.plan = plan
        self.kernels = plan.kernels
        self.progress = progress
        self.total = max(1, sum(source.nbytes for source in sources.values()))
        self.done = 0
        self.reported = 0.0
        self.used: set[str] = set()

    def fill(self) -> None:
        network, config = self.network, self.network.config
        for index, layer in enumerate(network.model.layers):
            prefix = f"model.layers.{index}."
            attn = layer.self_attn
            names = [f"{prefix}self_attn.{p}_proj" for p in ("q", "k", "v")]
            attn.qkv_proj = self.linear(names)
            attn.q_proj = attn.k_proj = attn.v_proj = None
            attn.o_proj = self.linear([f"{prefix}self_attn.o_proj"])
            mlp = layer.mlp
            mlp.gate_up_proj = self.linear([f"{prefix}mlp.gate_proj", f"{prefix}mlp.up_proj"])
            mlp.gate_proj = mlp.up_proj = None
            mlp.down_proj = self.linear([f"{prefix}mlp.down_proj"])
            self.small_tensors(layer, prefix)
            if attn.q_norm is not None and attn.k_norm is not None:
                attn.qk_norm_weight = attn.expanded_qk_norm_weight().detach().float().contiguous()
        self.small_tensors(network.model.norm, "model.norm.")
        self.embeddings(config.tie_word_embeddings)
        missing = [
            name
            for name, tensor in network.named_parameters(remove_duplicate=False)
            if tensor.is_meta
        ]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
        network.eval()

    def take(self, name: str) -> TensorSource:
        source = self.sources.get(name)
        if source is None:
            raise ValueError(f"checkpoint lacks the tensor {name}")
        if name not in self.used:
            self.used.add(name)
            self.done += source.nbytes
            fraction = self.done / self.total
            if self.progress is not None and fraction - self.reported >= 0.01:
                self.reported = fraction
                self.progress(fraction)
        return source

    def linear(self, stems: list[str]) -> nn.Module:
        sources = [self.take(f"{stem}.weight") for stem in stems]
        biases = [self.sources.get(f"{stem}.bias") for stem in stems]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat(
                [
                    self.take(b.name).dense() if b is not None else torch.zeros(s.shape[0])
                    for s, b in zip(sources, biases, strict=True)
                ]
            ).to(self.plan.device)
        if self.kernels is None:
            weight = torch.cat([s.dense().to(self.plan.dtype) for s in sources])
            dense_bias = None if bias is None else bias.to(self.plan.dtype)
            return DenseLinear(weight.to(self.plan.device), dense_bias)
        return linear_from_parts([self.packed(s) for s in sources], bias)

    def packed(self, source: TensorSource) -> PackedWeight:
        assert self.kernels is not None
        if source.type not in packed.PACKED_TYPES:
            name = packed.TYPE_NAMES.get(source.type, f"type {source.type}")
            raise UnsupportedTensor(f"tensor {source.name} is {name}, which modelhost cannot run")
        target = target_type(source.type, self.plan.mode)
        if target == source.type:
            return source.packed(self.kernels)
        return pack_float(source.dense(), target)

    def small_tensors(self, module: nn.Module, prefix: str) -> None:
        """The norms (and any other 1-D tensor) of `module` itself and its children, dense."""
        for name, param in list(module.named_parameters()):
            if not param.is_meta:
                continue
            owner = module.get_submodule(name.rpartition(".")[0]) if "." in name else module
            source = self.take(prefix + name)
            value = source.dense().to(device=self.plan.device, dtype=torch.float32)
            setattr(owner, name.rpartition(".")[2], nn.Parameter(value, requires_grad=False))

    def embeddings(self, tied: bool) -> None:
        network = self.network
        source = self.take("model.embed_tokens.weight")
        head = source if tied else self.take("lm_head.weight")
        if self.kernels is None:
            table = source.dense().to(device=self.plan.device, dtype=self.plan.dtype)
            network.model.embed_tokens = nn.Embedding.from_pretrained(table, freeze=True)
            weight = table if tied else head.dense().to(self.plan.device, self.plan.dtype)
            network.lm_head = DenseLinear(weight, None)
            return
        table = self.packed(source)
        network.model.embed_tokens = PackedEmbedding(table)
        network.lm_head = QuantLinear([table if tied else self.packed(head)], None)
