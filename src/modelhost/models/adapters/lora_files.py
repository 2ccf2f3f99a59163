"""A LoRA adapter's files, read into one neutral form: per (layer, projection), A and B.

Two layouts are read: a PEFT folder (`adapter_config.json` + `adapter_model.safetensors`, as
`save_pretrained` writes it) and llama.cpp's GGUF LoRA file (`general.type = adapter`,
`adapter.type = lora`, `adapter.lora.alpha`, tensors `blk.N.<part>.weight.lora_a` / `.lora_b`,
convert_lora_to_gguf.py). Either way a projection's update is `B @ A` times the adapter's own
scaling (PEFT: lora_alpha / r, or / sqrt(r) with rsLoRA; llama.cpp: alpha / rank, 1 without an
alpha), folded into B here, so a row's update is `scale * (x @ A^T) @ B^T`.

Only the decoder's linear projections are patched (q, k, v, o, gate, up, down); an adapter
that changes anything else (embeddings, the LM head, `modules_to_save`, DoRA, biases) is
refused by name, never served half applied.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from modelhost.models.adapters.refusals import AdapterRefused

# The projections an adapter may target, under their Hugging Face names.
PROJECTIONS = frozenset(
    {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj"}
    | {"gate_up_proj"}
)
# llama.cpp's tensor names for them (gguf-py's MODEL_TENSOR names, llama's block).
_GGUF_PARTS = {
    "attn_q": "q_proj",
    "attn_k": "k_proj",
    "attn_v": "v_proj",
    "attn_output": "o_proj",
    "attn_qkv": "qkv_proj",
    "ffn_gate": "gate_proj",
    "ffn_up": "up_proj",
    "ffn_down": "down_proj",
}
_PEFT_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_GGUF_KEY = re.compile(r"blk\.(\d+)\.(\w+)\.weight\.lora_([ab])$")
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True, slots=True)
class LoraFile:
    """An adapter as read: `targets[(layer, projection)] = (A [r, in], B [out, r])`, fp32,
    the adapter's scaling folded into B. `rows_permuted`: the q and k rows of B are in
    llama.cpp's interleaved order (a GGUF adapter of a Llama-family model)."""

    path: Path
    targets: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    identity: bytes  # a digest of the files' bytes: KV blocks computed under it are its own
    architecture: str | None = None  # GGUF's general.architecture, where the file says it
    rows_permuted: bool = False


def read_lora(path: Path) -> LoraFile:
    """The adapter at `path` (a PEFT folder or a GGUF file); AdapterRefused when it is
    neither, or changes what cannot be patched."""
    if path.is_dir():
        return _read_peft(path)
    if path.is_file() and path.suffix == ".gguf":
        return _read_gguf(path)
    raise AdapterRefused(
        f"{path} is not a LoRA adapter: a PEFT folder ({PEFT_CONFIG} + {PEFT_WEIGHTS}) "
        "or a llama.cpp GGUF LoRA file"
    )


def _digest(*files: Path) -> bytes:
    digest = hashlib.blake2b(digest_size=16)
    for file in files:
        with file.open("rb") as stream:
            while chunk := stream.read(1 << 20):
                digest.update(chunk)
    return digest.digest()


def _read_peft(folder: Path) -> LoraFile:
    from safetensors.torch import load_file

    config_path, weights_path = folder / PEFT_CONFIG, folder / PEFT_WEIGHTS
    if not config_path.is_file() or not weights_path.is_file():
        raise AdapterRefused(f"{folder} lacks {PEFT_CONFIG} or {PEFT_WEIGHTS}")
    config = json.loads(config_path.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterRefused(f"{folder} is a {config.get('peft_type')} adapter, not LoRA")
    for key, what in (
        ("modules_to_save", "modules_to_save"),
        ("use_dora", "DoRA"),
        ("alpha_pattern", "alpha_pattern"),
    ):
        if config.get(key):
            raise AdapterRefused(f"{folder}: {what} is not supported (only low-rank updates)")
    if config.get("bias", "none") != "none":
        raise AdapterRefused(f"{folder}: LoRA biases are not supported (bias='none' only)")
    alpha = float(config.get("lora_alpha", config.get("r", 8)))
    rslora = bool(config.get("use_rslora"))
    tensors = load_file(str(weights_path))
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _PEFT_KEY.search(key)
        if match is None or match.group(2) not in PROJECTIONS:
            raise AdapterRefused(f"{folder}: cannot patch {key} (only q, k, v, o, gate, up, down)")
        layer, name, part = int(match.group(1)), match.group(2), match.group(3)
        pairs.setdefault((layer, name), {})[part] = tensor.float()
    targets = {}
    for target, parts in pairs.items():
        if set(parts) != {"A", "B"}:
            raise AdapterRefused(f"{folder}: layer {target[0]} {target[1]} lacks lora_A or lora_B")
        a, b = parts["A"], parts["B"]
        rank = a.shape[0]
        scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
        targets[target] = (a.contiguous(), (b * scaling).contiguous())
    if not targets:
        raise AdapterRefused(f"{folder} holds no LoRA weights")
    return LoraFile(folder, targets, _digest(config_path, weights_path))


def _read_gguf(path: Path) -> LoraFile:
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(path))

    def text(key: str) -> str | None:
        field = reader.get_field(key)
        return None if field is None else str(field.contents())

    if text(gguf.Keys.General.TYPE) != "adapter" or text(gguf.Keys.Adapter.TYPE) != "lora":
        raise AdapterRefused(f"{path} is not a LoRA adapter (general.type = adapter, lora)")
    alpha_field = reader.get_field(gguf.Keys.Adapter.LORA_ALPHA)
    alpha = float(alpha_field.contents()) if alpha_field is not None else 0.0
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tensor in reader.tensors:
        match = _GGUF_KEY.match(tensor.name)
        name = _GGUF_PARTS.get(match.group(2)) if match is not None else None
        if match is None or name is None:
            raise AdapterRefused(f"{path}: cannot patch {tensor.name} (only projections)")
        shape = [int(n) for n in reversed(tensor.shape)]  # PyTorch's order: [rows, columns]
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        dense = torch.tensor(np.asarray(values, dtype=np.float32)).reshape(shape)  # a copy
        pairs.setdefault((int(match.group(1)), name), {})[match.group(3)] = dense
    targets = {}
    for target, parts in pairs.items():
        if set(parts) != {"a", "b"}:
            raise AdapterRefused(f"{path}: layer {target[0]} {target[1]} lacks lora_a or lora_b")
        a, b = parts["a"], parts["b"]
        scaling = alpha / b.shape[1] if alpha else 1.0  # llama-adapter.h's get_scale
        targets[target] = (a.contiguous(), (b * scaling).contiguous())
    if not targets:
        raise AdapterRefused(f"{path} holds no LoRA weights")
    architecture = text(gguf.Keys.General.ARCHITECTURE)
    return LoraFile(path, targets, _digest(path), architecture, rows_permuted=True)
