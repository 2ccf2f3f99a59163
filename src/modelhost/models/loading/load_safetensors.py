"""Hugging Face directories' *.safetensors, each tensor read on its own (models/loading/hf_config.py
reads config.json)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from modelhost.models.config import ModelConfig
from modelhost.models.loading import footprint


class SafetensorsTensor:
    """One tensor of a safetensors file, read when asked for (a models/loading/weights.py
    TensorSource). Floats other than F32, F16 and BF16 are read as fp32."""

    def __init__(
        self, file: Path, key: str, name: str, shape: tuple[int, ...], dtype: str, gemma_norm: bool
    ) -> None:
        self.file, self.key, self.name, self.stored_name = file, key, name, key
        self.shape = shape
        self.gemma_norm = gemma_norm  # Gemma stores norms as w, applied as (1 + w)
        self.type = footprint.safetensors_type(dtype)
        self.order: torch.Tensor | None = None
        self.nbytes = math.prod(shape) * _SIZES.get(dtype, 4)

    def _read(self) -> torch.Tensor:
        with safe_open(str(self.file), framework="pt") as handle:
            return handle.get_tensor(self.key)

    def dense(self) -> torch.Tensor:
        value = self._read().to(torch.float32)
        if self.order is not None:
            value = value[self.order]
        return value + 1.0 if self.gemma_norm else value

    @contextlib.contextmanager
    def stored(self) -> Iterator[int]:
        value = self._read()
        if value.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            value = value.to(torch.float32)
        value = value.contiguous()  # alive until the block ends
        yield value.data_ptr()


_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1}


def safetensors_tensors(directory: Path, config: ModelConfig) -> dict[str, SafetensorsTensor]:
    """Every tensor of the directory's *.safetensors files, under our parameter names, unread."""
    found: dict[str, SafetensorsTensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            keys = list(handle.keys())  # a safetensors handle is not iterable
            for key in keys:
                # Multimodal checkpoints keep the decoder under a prefix of their own
                # (SmolVLM: model.text_model.); their vision tensors keep their names.
                name = key.removeprefix("model.language_model.").removeprefix("language_model.")
                name = name.removeprefix("model.text_model.")
                if not name.startswith(("model.", "lm_head.")):
                    name = "model." + name
                gemma_norm = (
                    config.architecture == "gemma"
                    and name.startswith(("model.layers.", "model.norm."))  # not a vision tower's
                    and name.endswith("norm.weight")
                )
                tensor_slice = handle.get_slice(key)
                shape, dtype = tuple(tensor_slice.get_shape()), tensor_slice.get_dtype()
                found[name] = SafetensorsTensor(file, key, name, shape, dtype, gemma_norm)
    return found
