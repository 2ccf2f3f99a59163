"""LoRA updates per row of a batch, over one copy of the base weights.

A step runs every projection's base matmul once for the whole batch (native quantized
kernels, PyTorch's quantized or dense linears: whichever the model holds), then adds each
row's low-rank update, `scale * (x @ A^T) @ B^T`, for its own adapter: the step's adapters are
stacked into one A and one B a host module, and a mask of each token's scale on its own
adapter's rank columns picks its update, so a module costs two small matmuls whatever the mix.
Rows of the bare base get nothing added.

On the module-by-module path (prompt steps, and networks without the one-call native decode)
the updates are added by forward hooks on the projections the network runs (the fused q|k|v
and gate|up linears a loaded network holds, o and down), so the layers' code stays as it is.
The last layer projects only the tokens whose logits are wanted after its attention
(decoder.py's `keep`): its o, gate|up and down hooks take the step's kept rows. A decode step
on the one-call native path (models/kernels/fused_decode.py) adds them inside that call
(native_lora.h), from a bf16 copy of the same stacks made once for the set of adapters: the
step reads half the bytes of the fp32 stacks, and rows of the bare base are skipped there.
"""

from __future__ import annotations

import ctypes
import hashlib
import struct
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from modelhost.models.adapters.lora_files import LoraFile
from modelhost.models.adapters.refusals import AdapterRefused
from modelhost.models.kernels.fused_decode import LORA_HOSTS
from modelhost.models.kernels.structs import NativeLora, NativeLoraTarget
from modelhost.models.loading.load_gguf import PERMUTED_ARCHITECTURES, unpermuted_rows
from modelhost.models.networks.decoder import DecoderLM
from modelhost.models.networks.layers import GatedMLP, partial_rotary_rows

# (start, stop) of each projection's output columns in the module that computes it.
Segments = dict[str, tuple[int, int]]
# Up to this many tokens (decode steps, short prompts) a step's low-rank updates run on one
# intra-op thread: each is a few small matmuls, which a second thread slows down many times
# over on a shared machine (each op waits for a preempted thread: a 1B model's decode step
# with all seven projections adapted took 1.5 s against 0.7 s without updates, on 2 loaded
# cores); longer prompts keep the threads their larger matmuls use.
ONE_THREAD_TOKENS = 64


# One adapter's update of a host module: per target it patches, its output columns in the host
# (start, stop), its A [rank, in] and its B [out columns, rank]. A step stacks these across
# its adapters (`_stack`).
HostUpdate = tuple[tuple[int, int, torch.Tensor, torch.Tensor], ...]


@dataclass(frozen=True, slots=True, eq=False)
class LoraAdapter:
    """An adapter fitted to a base network: its updates by (layer, host module)."""

    name: str
    path: str
    identity: bytes
    updates: dict[tuple[int, str], HostUpdate]
    nbytes: int


@dataclass(frozen=True, slots=True, eq=False, weakref_slot=True)
class AdapterUse:
    """What a row runs with: an adapter at a scale. Rows of the same adapter at different
    scales compute different KV, so `kv_salt` (the prefix cache's and the disk store's key
    salt) names both. One per row (identity equality): the adapter set sees which are alive."""

    adapter: LoraAdapter
    scale: float = 1.0

    @property
    def kv_salt(self) -> bytes:
        digest = hashlib.blake2b(self.adapter.identity, digest_size=16)
        digest.update(struct.pack("<d", self.scale))
        return digest.digest()


def host_segments(network: DecoderLM, layer: int) -> dict[str, tuple[str, Segments]]:
    """Each projection of layer `layer` that can be patched: its host module's name and the
    host's output columns that are its own (q, k and v share one fused linear)."""
    config = network.config
    block = network.model.blocks()[layer]
    attn, mlp = block.self_attn, block.mlp
    q = config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    found: dict[str, tuple[str, Segments]] = {}
    if attn.qkv_proj is not None:
        qkv = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}
        qkv["qkv_proj"] = (0, q + 2 * kv)
        for name in qkv:
            found[name] = ("self_attn.qkv_proj", qkv)
    else:
        for name, width in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            found[name] = (f"self_attn.{name}", {name: (0, width)})
    found["o_proj"] = ("self_attn.o_proj", {"o_proj": (0, config.hidden_size)})
    if isinstance(mlp, GatedMLP):  # an expert layer's MLP is not patched
        width = mlp.intermediate
        if mlp.gate_up_proj is not None:
            gate_up = {"gate_proj": (0, width), "up_proj": (width, 2 * width)}
            gate_up["gate_up_proj"] = (0, 2 * width)
            for name in gate_up:
                found[name] = ("mlp.gate_up_proj", gate_up)
        else:
            for name in ("gate_proj", "up_proj"):
                found[name] = (f"mlp.{name}", {name: (0, width)})
        found["down_proj"] = ("mlp.down_proj", {"down_proj": (0, config.hidden_size)})
    return found


def _in_features(network: DecoderLM, name: str, layer: int) -> int:
    config = network.config
    if name == "o_proj":
        return config.num_heads * config.head_dim
    if name == "down_proj":
        mlp = network.model.blocks()[layer].mlp
        return mlp.intermediate if isinstance(mlp, GatedMLP) else -1
    return config.hidden_size


def _base_rows(network: DecoderLM, lora: LoraFile, name: str, b: torch.Tensor) -> torch.Tensor:
    """B's rows in the order the base's q and k rows are held (loading/load_gguf.py undoes
    llama.cpp's interleaving, loading/loader.py reorders partial rotary heads)."""
    config = network.config
    heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}.get(name)
    if heads is None:
        return b
    if lora.rows_permuted and (lora.architecture or "llama") in PERMUTED_ARCHITECTURES:
        b = b[unpermuted_rows(b.shape[0], heads)]
    if config.rope_dim is not None and config.rope_dim != config.head_dim:
        b = b[partial_rotary_rows(heads, config.head_dim, config.rope_dim)]
    return b


# Hugging Face model types GGUF files name otherwise (llama.cpp converts Mistral as llama).
_GGUF_NAMES = {"mistral": "llama", "qwen25vl": "qwen2vl"}


def _family(architecture: str) -> str:
    """An architecture's GGUF name, from a GGUF's general.architecture or a config's
    model_type alike (qwen3_moe and qwen3moe, mistral and llama)."""
    name = architecture.lower().replace("_", "")
    return _GGUF_NAMES.get(name, name)


def fit_adapter(name: str, lora: LoraFile, network: DecoderLM, dtype: torch.dtype) -> LoraAdapter:
    """`lora` as updates of `network`'s modules; AdapterRefused where it was made for another
    architecture (a GGUF adapter says which), its shapes are not the base's (another base) or
    it targets what cannot be patched here."""
    config = network.config
    if lora.architecture is not None and _family(lora.architecture) != _family(config.model_type):
        raise AdapterRefused(
            f"adapter '{name}' was made for a {lora.architecture} model; this base is "
            f"{config.model_type}"
        )
    device = network.model.norm.weight.device
    grouped: dict[tuple[int, str], list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {}
    for (layer, target), (a, b) in sorted(lora.targets.items()):
        if layer >= config.num_layers:
            raise AdapterRefused(
                f"adapter '{name}' does not fit this base: it patches layer {layer}, "
                f"the base has {config.num_layers} layers"
            )
        hosts = host_segments(network, layer)
        if target not in hosts:
            raise AdapterRefused(
                f"adapter '{name}' targets {target} of layer {layer}, which cannot be patched "
                "here (a mixture-of-experts layer's MLP)"
            )
        host, segments = hosts[target]
        start, stop = segments[target]
        expected = (_in_features(network, target, layer), stop - start)
        if a.shape[1] != expected[0] or b.shape[0] != expected[1] or a.shape[0] != b.shape[1]:
            raise AdapterRefused(
                f"adapter '{name}' does not fit this base: layer {layer} {target} maps "
                f"{expected[0]} to {expected[1]} features, the adapter {a.shape[1]} "
                f"to {b.shape[0]} (rank {a.shape[0]} and {b.shape[1]})"
            )
        b = _base_rows(network, lora, target, b)
        grouped.setdefault((layer, host), []).append((start, stop, a, b))
    updates: dict[tuple[int, str], HostUpdate] = {}
    nbytes = 0
    for key, parts in grouped.items():
        placed = []
        for start, stop, a, b in parts:
            a, b = (t.to(device=device, dtype=dtype).contiguous() for t in (a, b))
            placed.append((start, stop, a, b))
            nbytes += a.numel() * a.element_size() + b.numel() * b.element_size()
        updates[key] = tuple(placed)
    return LoraAdapter(name, str(lora.path), lora.identity, updates, nbytes)


@dataclass(frozen=True, slots=True)
class _Stacked:
    """A step's adapters stacked for one host module, target by target: `a` [in, R] holds
    every adapter's A of the first target, then of the next (transposed); each target's B of
    every adapter side by side in `targets` (its output columns, its rank columns of `a`, its
    B transposed [ranks, out columns]). `owners`: the step's adapter each rank column belongs
    to, and `layout` the key of its mask."""

    a: torch.Tensor
    targets: tuple[tuple[int, int, int, int, torch.Tensor], ...]
    owners: torch.Tensor
    layout: tuple[tuple[int, int], ...]  # (adapter index, rank) in column order

    @property
    def nbytes(self) -> int:
        held = [self.a, *(b for *_, b in self.targets)]
        return sum(t.numel() * t.element_size() for t in held)


def _stack(adapters: Sequence[LoraAdapter], key: tuple[int, str]) -> _Stacked | None:
    """`adapters`' updates of host `key` as one A and one B a target; None when none patches
    it."""
    by_target: dict[tuple[int, int], list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for i, adapter in enumerate(adapters):
        for start, stop, a, b in adapter.updates.get(key, ()):
            by_target.setdefault((start, stop), []).append((i, a, b))
    if not by_target:
        return None
    a_rows: list[torch.Tensor] = []
    targets: list[tuple[int, int, int, int, torch.Tensor]] = []
    layout: list[tuple[int, int]] = []
    column = 0
    for (start, stop), parts in sorted(by_target.items()):
        a_rows += [a for _, a, _ in parts]
        ranks = sum(a.shape[0] for _, a, _ in parts)
        b = torch.cat([b for _, _, b in parts], dim=1).contiguous()
        targets.append((start, stop, column, column + ranks, b))
        layout += [(i, a.shape[0]) for i, a, _ in parts]
        column += ranks
    # Held transposed, [in, R] and [ranks, out]: a step's matmuls then read them in order.
    a = torch.cat(a_rows).T.contiguous()
    targets = [(start, stop, c0, c1, b.T.contiguous()) for start, stop, c0, c1, b in targets]
    owners = torch.cat([torch.full((rank,), i, dtype=torch.long) for i, rank in layout])
    return _Stacked(a, tuple(targets), owners.to(a.device), tuple(layout))


@dataclass(frozen=True, slots=True)
class _NativeStacks:
    """A set's stacks as the native decode call reads them (native_lora.h): a NativeLora for
    each layer's LORA_HOSTS, each patched one pointing into bf16 copies held here."""

    hosts: ctypes.Array  # NativeLora [layers * len(LORA_HOSTS)]
    patched: tuple[tuple[int, _Stacked], ...]  # its index in hosts, its stack (the mask's key)
    held: tuple[object, ...]  # the bf16 tensors and target arrays `hosts` points into
    nbytes: int


def _native_stacks(
    stacked: Callable[[tuple[int, str]], _Stacked | None], layers: int
) -> _NativeStacks:
    """Every host's stack (`stacked`) in bf16, described for the native decode call."""
    hosts = (NativeLora * (layers * len(LORA_HOSTS)))()
    patched: list[tuple[int, _Stacked]] = []
    held: list[object] = []
    for layer in range(layers):
        for slot, host in enumerate(LORA_HOSTS):
            found = stacked((layer, host))
            if found is None:
                continue
            a = found.a.T.to(torch.bfloat16).contiguous()  # [R, in]: a row per rank column
            targets = (NativeLoraTarget * len(found.targets))()
            for i, (start, stop, c0, c1, b) in enumerate(found.targets):
                b16 = b.to(torch.bfloat16).contiguous()  # [ranks, out columns]
                targets[i] = NativeLoraTarget(start, stop, c0, c1 - c0, b16.data_ptr())
                held.append(b16)
            held += [a, targets]
            index = layer * len(LORA_HOSTS) + slot
            hosts[index] = NativeLora(
                a=a.data_ptr(),
                targets=ctypes.addressof(targets),
                count=len(targets),
                ranks=a.shape[0],
                in_features=a.shape[1],
            )
            patched.append((index, found))
    tensors = [t for t in held if isinstance(t, torch.Tensor)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return _NativeStacks(hosts, tuple(patched), tuple(held), nbytes)


# The stacked matrices of this many sets of adapters are kept (a copy of their weights each,
# and a bf16 one once a decode step ran natively; counted with the adapters' bytes): rows come
# and go, and a step with the same adapters as a recent one reuses what was stacked for it.
STACKED_SETS = 2


class _StackSet:
    """One set of adapters' stacked matrices, made as steps need them: a host module's fp32
    stack for the hooks, and all of them in bf16 for the native decode call."""

    def __init__(self, adapters: tuple[LoraAdapter, ...], layers: int) -> None:
        self.adapters = adapters
        self.layers = layers
        self.hosts: dict[tuple[int, str], _Stacked | None] = {}
        self._native: _NativeStacks | None = None

    def stacked(self, key: tuple[int, str]) -> _Stacked | None:
        if key not in self.hosts:
            self.hosts[key] = _stack(self.adapters, key)
        return self.hosts[key]

    def native(self) -> _NativeStacks:
        if self._native is None:
            self._native = _native_stacks(self.stacked, self.layers)
        return self._native

    @property
    def nbytes(self) -> int:
        native = self._native.nbytes if self._native is not None else 0
        return native + sum(s.nbytes for s in list(self.hosts.values()) if s is not None)


class _Step:
    """One step's adapters: which each token runs with, at what scale, and the stacked
    matrices of each host module (shared by the steps that run the same adapters)."""

    def __init__(
        self, uses: Sequence[AdapterUse | None], kept: torch.Tensor, stacks: _StackSet
    ) -> None:
        index = {id(adapter): i for i, adapter in enumerate(stacks.adapters)}
        owner = [-1 if use is None else index[id(use.adapter)] for use in uses]
        scale = [0.0 if use is None else use.scale for use in uses]
        self.stacks = stacks
        self.owner = torch.tensor(owner, device=kept.device)
        self.scale = torch.tensor(scale, device=kept.device)
        self.kept_owner = self.owner.index_select(0, kept)
        self.kept_scale = self.scale.index_select(0, kept)
        self._masks: dict[tuple[object, ...], torch.Tensor] = {}

    def mask(self, stacked: _Stacked, kept: bool, dtype: torch.dtype | None = None) -> torch.Tensor:
        """[tokens, R]: each token's scale on its own adapter's rank columns, 0 elsewhere
        (so the bare base's tokens and other adapters' columns add nothing); in `dtype`, the
        stack's by default."""
        dtype = dtype or stacked.a.dtype
        key = (stacked.layout, kept, dtype)
        mask = self._masks.get(key)
        if mask is None:
            owner, scale = (self.kept_owner, self.kept_scale) if kept else (self.owner, self.scale)
            mine = owner[:, None] == stacked.owners[None, :]
            mask = self._masks[key] = mine.to(dtype) * scale[:, None].to(dtype)
        return mask

    def native(self) -> ctypes.Array:
        """The native decode call's NativeLora for every layer's hosts, with this step's masks
        (every token: that call runs all of them through the last layer)."""
        native = self.stacks.native()
        for index, stacked in native.patched:
            native.hosts[index].mask = self.mask(stacked, False, torch.float32).data_ptr()
        return native.hosts


class RowAdapters:
    """The hooks on a network's projections, and the step they add updates for.

    A step's adapters are stacked a host module at a time (every adapter's A rows in one
    matrix, their B columns in another), so a module's update is two matmuls whatever mix of
    adapters and scales its rows run with: the per-token mask of scales picks each row's own
    rank columns."""

    def __init__(self, network: DecoderLM) -> None:
        self.network = network
        self._step: _Step | None = None
        self._stacked: dict[tuple[int, ...], _StackSet] = {}
        last = network.config.num_layers - 1
        for layer in range(network.config.num_layers):
            hosts = {host for host, _ in host_segments(network, layer).values()}
            for host in hosts:
                module = network.model.blocks()[layer].get_submodule(host)
                # The last layer's o, gate|up and down see only the kept tokens.
                attends = host.startswith("self_attn.") and host != "self_attn.o_proj"
                kept = layer == last and not attends
                module.register_forward_hook(self._hook(layer, host, kept))

    @contextmanager
    def step(self, uses: Sequence[AdapterUse | None], kept: torch.Tensor) -> Iterator[None]:
        """Add each token's adapter update in the forwards run inside (`uses`: one a token,
        None for the base; `kept`: the step's logits_index)."""
        if all(use is None for use in uses):
            yield
            return
        # In one order whatever the rows' order, so a step with the same adapters reuses the
        # stacks a recent one made.
        distinct = {id(u.adapter): u.adapter for u in uses if u is not None}
        adapters = tuple(distinct[key] for key in sorted(distinct))
        step = self._step = _Step(uses, kept, self._stacks_for(adapters))
        # A decode step on the one-call native path adds the updates there (the hooks then
        # never run); any other step runs the modules, and the hooks add them.
        fused = self.network.fused_decode()
        if fused is not None:
            fused.lora = step.native
        try:
            yield
        finally:
            self._step = None
            if fused is not None:
                fused.lora = None

    def stacked_bytes(self) -> int:
        """The stacked copies kept of recent steps' adapters."""
        return sum(stacks.nbytes for stacks in list(self._stacked.values()))

    def _stacks_for(self, adapters: tuple[LoraAdapter, ...]) -> _StackSet:
        key = tuple(id(adapter) for adapter in adapters)
        found = self._stacked.pop(key, None)
        if found is None or any(x is not y for x, y in zip(found.adapters, adapters, strict=True)):
            found = _StackSet(adapters, self.network.config.num_layers)
        self._stacked[key] = found  # the most recent last
        while len(self._stacked) > STACKED_SETS:
            del self._stacked[next(iter(self._stacked))]
        return found

    def _hook(
        self, layer: int, host: str, kept: bool
    ) -> Callable[[nn.Module, tuple[torch.Tensor, ...], torch.Tensor], None]:
        key = (layer, host)

        def add_updates(
            module: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor
        ) -> None:
            step = self._step
            if step is None:
                return
            stacked = step.stacks.stacked(key)
            if stacked is None:
                return
            x = args[0]
            threads = torch.get_num_threads()
            alone = threads > 1 and x.device.type == "cpu" and x.shape[0] <= ONE_THREAD_TOKENS
            if alone:
                torch.set_num_threads(1)
            try:
                low = torch.mm(x.to(stacked.a.dtype), stacked.a)
                low.mul_(step.mask(stacked, kept))
                same = low.dtype == output.dtype
                for start, stop, c0, c1, b in stacked.targets:
                    if same:  # the update added in the matmul's own pass
                        output[:, start:stop].addmm_(low[:, c0:c1], b)
                    else:
                        output[:, start:stop].add_(torch.mm(low[:, c0:c1], b).to(output.dtype))
            finally:
                if alone:
                    torch.set_num_threads(threads)

        return add_updates
