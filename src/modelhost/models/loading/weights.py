"""Filling a network with a checkpoint's weights, one tensor at a time.

The network is built on the meta device (no memory), then each of its linears is made from the
checkpoint's tensors in the form the mode asks for (loading/quant.py): packed in the file's own
quantization for the native kernels, or dense. Tensors are read one at a time from their
source (a GGUF file, safetensors files), so loading holds the model's final form plus one
tensor, never the whole model in fp32.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol, cast

import torch
from torch import nn

from modelhost.models.kernels import native
from modelhost.models.kernels.packed import PackedEmbedding, PackedWeight, QuantLinear
from modelhost.models.loading import footprint
from modelhost.models.loading.footprint import target_type, unsupported_tensor
from modelhost.models.loading.packed_cache import PackedCache, weight_key
from modelhost.models.loading.quant import (
    Bf16Linear,
    DenseLinear,
    bf16_gemm_in_hardware,
    pack_float,
)
from modelhost.models.networks.decoder import DecoderLM
from modelhost.models.networks.layers import GatedMLP
from modelhost.models.networks.moe import SparseMoE


class TensorSource(Protocol):
    """One tensor of a checkpoint, read when asked for."""

    name: str  # our (Hugging Face) parameter name
    stored_name: str  # the file's own name for it
    shape: tuple[int, ...]  # PyTorch's order: [out, in] for a linear's weight
    type: int  # its GGUF type id (safetensors tensors: F32, F16 or BF16)
    nbytes: int  # bytes in the file
    order: torch.Tensor | None  # our row r is the file's row order[r] (None: the same)

    def dense(self) -> torch.Tensor:
        """The tensor in fp32 (dequantized), rows in our order."""
        ...

    def stored(self) -> AbstractContextManager[int]:
        """The address of the tensor's bytes as the file stores them (row-major, the file's
        row order), valid inside the block."""
        ...


@dataclass(frozen=True, slots=True)
class WeightPlan:
    """How to hold the weights: `mode` (models/loading/quant.py), and the device and dtype of dense
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
    cache: PackedCache | None = None,
) -> None:
    """Gives a meta-device `network` every weight from `sources`, in the plan's forms; packed
    weights come from `cache` where it has them, and what is repacked is given to it."""
    loader = _Filler(network, sources, plan, progress, cache)
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


def linear_from(
    sources: Mapping[str, TensorSource], stems: list[str], plan: WeightPlan
) -> nn.Module:
    """One linear made of the `stems` (`<stem>.weight`, and `<stem>.bias` where present) laid
    side by side, in the plan's form: what a vision tower's layers are built from, on the same
    kernels and quantization rules as the text model's. A weight whose rows blocks of 32 do not
    tile (SigLIP-so400m's 4304-wide MLP) keeps its float type where the mode would quantize it.

    A tower's linears see every patch of every tile at once (17 tiles of 1,024 patches for one
    SmolVLM image), so 16-bit float weights there take PyTorch's bf16 GEMM where the CPU has
    bf16 dot products (Bf16Linear: twice the native kernels' speed at those row counts, the same
    bytes); F32 weights, asked for at full precision, stay on the native kernels."""
    weights = [sources[f"{s}.weight"] for s in stems]
    if plan.mode in ("int8", "int4") and any(w.shape[1] % 32 for w in weights):
        plan = dataclasses.replace(plan, mode="auto")
    if (
        plan.kernels is not None
        and all(target_type(w.type, plan.mode) in (footprint.F16, footprint.BF16) for w in weights)
        and bf16_gemm_in_hardware()
    ):
        biases = [sources.get(f"{s}.bias") for s in stems]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat(
                [
                    b.dense() if b is not None else torch.zeros(w.shape[0])
                    for w, b in zip(weights, biases, strict=True)
                ]
            )
        return Bf16Linear(torch.cat([w.dense() for w in weights]), bias)
    return _Filler(cast(DecoderLM, None), sources, plan, None).linear(stems)


class _Filler:
    def __init__(
        self,
        network: DecoderLM,
        sources: Mapping[str, TensorSource],
        plan: WeightPlan,
        progress: Progress | None,
        cache: PackedCache | None = None,
    ) -> None:
        self.network = network
        self.cache = cache
        self.sources = sources
        self.plan = plan
        self.kernels = plan.kernels
        self.progress = progress
        self.total = max(1, sum(source.nbytes for source in sources.values()))
        self.done = 0
        self.reported = 0.0
        self.used: set[str] = set()

    def fill(self) -> None:
        refusal = unsupported_tensor(
            (s.stored_name, s.type, len(s.shape)) for s in self.sources.values()
        )
        if refusal is not None:
            raise UnsupportedTensor(refusal)
        network, config = self.network, self.network.config
        for index, layer in enumerate(network.model.blocks()):
            prefix = f"model.layers.{index}."
            attn = layer.self_attn
            names = [f"{prefix}self_attn.{p}_proj" for p in ("q", "k", "v")]
            attn.qkv_proj = self.linear(self.stored_fused(f"{prefix}self_attn.qkv_proj", names))
            attn.q_proj = attn.k_proj = attn.v_proj = None
            attn.o_proj = self.linear([f"{prefix}self_attn.o_proj"])
            if isinstance(layer.mlp, SparseMoE):  # the router is a small tensor, below
                for expert, mlp in enumerate(layer.mlp.experts):
                    self.gated_mlp(cast(GatedMLP, mlp), f"{prefix}mlp.experts.{expert}.")
            else:
                self.gated_mlp(layer.mlp, f"{prefix}mlp.")
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
        if self.progress is not None:
            self.progress(1.0)  # whatever the checkpoint held that this network does not use

    def gated_mlp(self, mlp: GatedMLP, prefix: str) -> None:
        names = [f"{prefix}gate_proj", f"{prefix}up_proj"]
        mlp.gate_up_proj = self.linear(self.stored_fused(f"{prefix}gate_up_proj", names))
        mlp.gate_proj = mlp.up_proj = None
        mlp.down_proj = self.linear([f"{prefix}down_proj"])

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

    def stored_fused(self, fused: str, parts: list[str]) -> list[str]:
        """[fused] where the checkpoint stores the parts as one tensor already (Phi-3's
        qkv_proj and gate_up_proj), else the parts."""
        return [fused] if f"{fused}.weight" in self.sources else parts

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
        fused = self.fused(sources)
        parts = [fused] if fused is not None else [self.packed(s) for s in sources]
        return QuantLinear(parts, bias)

    def fused(self, sources: list[TensorSource]) -> PackedWeight | None:
        """Parts kept in one shared type, repacked side by side into one weight (one kernel
        call a step), or None where they cannot be."""
        assert self.kernels is not None
        first = sources[0]
        if len(sources) == 1 or any(
            s.type != first.type
            or s.shape[1] != first.shape[1]
            or target_type(s.type, self.plan.mode, s.shape[1]) != s.type
            or s.type not in footprint.PACKED_TYPES
            for s in sources
        ):
            return None
        if any(s.shape[0] % 16 for s in sources[:-1]):
            return None
        outs = [s.shape[0] for s in sources]
        key = weight_key([s.name for s in sources], first.type, outs, first.shape[1])
        cached = self.cache.get(key) if self.cache is not None else None
        if cached is not None:
            return cached
        weight, slices = PackedWeight.empty(self.kernels, first.type, outs, first.shape[1])
        for source, arrays in zip(sources, slices, strict=True):
            with source.stored() as address:
                out, width = source.shape
                self.kernels.repack(source.type, address, out, width, source.order, arrays)
        if self.cache is not None:
            self.cache.keep(key, weight)
        return weight

    def packed(self, source: TensorSource) -> PackedWeight:
        assert self.kernels is not None
        out, width = source.shape
        key = weight_key([source.name], source.type, [out], width)
        cached = self.cache.get(key) if self.cache is not None else None
        if cached is not None:
            return cached
        target = target_type(source.type, self.plan.mode, width)
        if target != source.type:
            weight = pack_float(source.dense(), target)
        else:
            with source.stored() as address:
                weight = PackedWeight.repack(
                    self.kernels, source.type, address, out, width, source.order
                )
        if self.cache is not None:
            self.cache.keep(key, weight)
        return weight

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
        packed_table = self.packed(source)
        network.model.embed_tokens = PackedEmbedding(packed_table)
        network.lm_head = QuantLinear([packed_table if tied else self.packed(head)], None)
