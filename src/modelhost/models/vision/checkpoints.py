"""A vision tower's tensors under the neutral names models/vision/siglip.py reads, from a
Hugging Face checkpoint or a llama.cpp `mmproj` GGUF (the names its converter writes:
`v.patch_embd`, `v.blk.N.attn_q`, `mm.model.fc`, ...)."""

from __future__ import annotations

import contextlib
import copy
import math
import re
from collections.abc import Iterator, Mapping

import torch

from modelhost.models.loading.weights import TensorSource

# Within a SigLIP encoder layer: Hugging Face's part name and llama.cpp's, to ours.
_HF_LAYER = {
    "self_attn.q_proj": "q",
    "self_attn.k_proj": "k",
    "self_attn.v_proj": "v",
    "self_attn.out_proj": "out",
    "layer_norm1": "norm1",
    "layer_norm2": "norm2",
    "mlp.fc1": "fc1",
    "mlp.fc2": "fc2",
}
_GGUF_LAYER = {
    "attn_q": "q",
    "attn_k": "k",
    "attn_v": "v",
    "attn_out": "out",
    "ln1": "norm1",
    "ln2": "norm2",
    "ffn_up": "fc1",
    "ffn_down": "fc2",
}
_HF_TOP = {
    "embeddings.patch_embedding": "patch",
    "embeddings.position_embedding": "position",
    "post_layernorm": "post_norm",
}
_GGUF_TOP = {
    "v.patch_embd": "patch",
    "v.position_embd": "position",
    "v.post_ln": "post_norm",
    "mm.model.fc": "projector",  # Idefics3's connector
    "mm.input_projection": "projector",  # Gemma 3's (stored [text, vision], as a linear)
    "mm.soft_emb_norm": "projector_norm",
}
_HF_LAYER_NAME = re.compile(r"encoder\.layers\.(\d+)\.(.+)\.(weight|bias)$")
_GGUF_LAYER_NAME = re.compile(r"v\.blk\.(\d+)\.(\w+)\.(weight|bias)$")


class _Flat:
    """A source seen as 2-D [out, in] (the patch convolution's [out, c, k, k] kernel: a
    linear over each patch's flattened pixels)."""

    def __init__(self, source: TensorSource, name: str) -> None:
        self.source = source
        self.name, self.stored_name = name, source.stored_name
        self.shape: tuple[int, ...] = (source.shape[0], math.prod(source.shape[1:]))
        self.type, self.nbytes, self.order = source.type, source.nbytes, source.order

    def dense(self) -> torch.Tensor:
        return self.source.dense().reshape(self.shape)

    @contextlib.contextmanager
    def stored(self) -> Iterator[int]:
        with self.source.stored() as address:
            yield address


def renamed(source: TensorSource, name: str) -> TensorSource:
    if name == "patch.weight" and len(source.shape) > 2:
        return _Flat(source, name)
    renamed = copy.copy(source)
    renamed.name = name
    return renamed


def hf_vision_tensors(
    sources: Mapping[str, TensorSource], vision_prefixes: tuple[str, ...], projector: dict[str, str]
) -> dict[str, TensorSource]:
    """The tensors under the first of `vision_prefixes` a tensor has (say
    `model.vision_model.`), and the `projector` tensors (checkpoint name -> ours), under our
    names."""
    found: dict[str, TensorSource] = {}
    for key, source in sources.items():
        if key in projector:
            found[projector[key]] = renamed(source, projector[key])
            continue
        prefix = next((p for p in vision_prefixes if key.startswith(p)), None)
        if prefix is None:
            continue
        name = our_name(key.removeprefix(prefix), _HF_LAYER_NAME, _HF_LAYER, _HF_TOP)
        if name is not None:
            found[name] = renamed(source, name)
    return found


def gguf_vision_tensors(sources: Mapping[str, TensorSource]) -> dict[str, TensorSource]:
    """An mmproj file's tensors (keyed by their GGUF names) under our names."""
    found: dict[str, TensorSource] = {}
    for key, source in sources.items():
        name = our_name(key, _GGUF_LAYER_NAME, _GGUF_LAYER, _GGUF_TOP)
        if name is not None:
            found[name] = renamed(source, name)
    return found


def our_name(
    key: str, layer_name: re.Pattern[str], layer_parts: Mapping[str, str], top: Mapping[str, str]
) -> str | None:
    """A checkpoint's tensor name under ours: `layers.N.PART.KIND` for a layer's tensor
    (`layer_name` matches layer, part and kind), `TOP.KIND` for one outside the layers; None
    for a tensor the tower does not take."""
    match = layer_name.match(key)
    if match:
        layer, part, kind = match.groups()
        return f"layers.{layer}.{layer_parts[part]}.{kind}" if part in layer_parts else None
    stem, _, kind = key.rpartition(".")
    return f"{top[stem]}.{kind}" if stem in top else None
