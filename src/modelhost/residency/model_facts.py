"""What a client may read of a local model without loading it: how many parameters it has, the
quantization of its weights, its context length, its chat template and what its family record
says it can do (reasoning, vision). Read from a GGUF header, or a Hugging Face folder's
config.json, tokenizer_config.json and safetensors headers; once per file (by path, size and
modification time), so a client listing models again reads nothing twice.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modelhost.models.families import family_for_model
from modelhost.models.loading.footprint import TYPE_NAMES
from modelhost.models.loading.gguf_header import GGUFFile
from modelhost.models.loading.hf_config import read_json
from modelhost.models.vision.pairing import reads_images
from modelhost.residency.registry import ModelEntry, _safetensors_tensors

# llama.cpp's `general.file_type` (LLAMA_FTYPE): what a GGUF says its quantization is.
FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
    11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
    17: "Q5_K_M", 18: "Q6_K", 32: "BF16",
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class ModelFacts:
    parameter_count: int | None
    quantization: str  # "Q4_K_M", or a folder's dtype ("BF16"); "" when unknown
    context_length: int | None
    embedding_length: int | None
    chat_template: str | None  # the model's own, else its family's (None: it has none)
    reasoning: bool  # its family record (or template) marks reasoning
    vision: bool
    # The header's scalar fields (general.*, <architecture>.*), as GGUF tools show them.
    metadata: dict[str, Any] = field(default_factory=dict)


UNKNOWN = ModelFacts(None, "", None, None, None, False, False)


def model_facts(entry: ModelEntry) -> ModelFacts:
    """The entry's facts; a file that went away or cannot be read has none (a listing lists
    it still, as the registry does until its next scan)."""
    try:
        stat = entry.path.stat()
        facts = _facts(entry.path, entry.format, entry.architecture, stat.st_size, stat.st_mtime_ns)
        # A projector named by `serve --mmproj` reads images as one beside the file does.
        return dataclasses.replace(facts, vision=True) if entry.mmproj is not None else facts
    except (OSError, ValueError, KeyError, TypeError):
        return UNKNOWN


@functools.lru_cache(maxsize=64)
def _facts(path: Path, fmt: str, architecture: str | None, size: int, mtime_ns: int) -> ModelFacts:
    if fmt == "gguf":
        return _gguf_facts(path)
    if path.is_dir() and (path / "config.json").is_file():
        return _folder_facts(path, architecture)
    return UNKNOWN


def _gguf_facts(path: Path) -> ModelFacts:
    header = GGUFFile(path)
    arch = header.architecture
    template = header.field("tokenizer.chat_template")
    parameters = sum(math.prod(t["shape"]) for t in header.tensors)
    quantization = FILE_TYPES.get(header.field("general.file_type", -1), "")
    if not quantization:  # the type most weights are stored as
        counts = Counter(t["type"] for t in header.tensors if len(t["shape"]) >= 2)
        quantization = TYPE_NAMES.get(counts.most_common(1)[0][0], "") if counts else ""
    metadata = {
        key: value
        for key, value in header.fields.items()
        if (key.startswith(("general.", f"{arch}.")))
        and isinstance(value, str | int | float | bool)
    }
    metadata.setdefault("general.parameter_count", parameters)
    context = header.arch_field("context_length")
    embedding = header.arch_field("embedding_length")
    facts = _with_family(
        arch,
        template if isinstance(template, str) else None,
        parameter_count=parameters,
        quantization=quantization,
        context_length=int(context) if context is not None else None,
        embedding_length=int(embedding) if embedding is not None else None,
        metadata=metadata,
    )
    # A GGUF reads images when an mmproj we compute sits beside it (models/vision/pairing.py).
    return dataclasses.replace(facts, vision=True) if reads_images(path) else facts


def _folder_facts(path: Path, architecture: str | None) -> ModelFacts:
    raw = read_json(path / "config.json")
    settings = (
        read_json(path / "tokenizer_config.json")
        if (path / "tokenizer_config.json").is_file()
        else {}
    )
    template = settings.get("chat_template")
    if (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    tensors = [t for f in sorted(path.glob("*.safetensors")) for t in _safetensors_tensors(f)]
    parameters = sum(math.prod(dims) for _, _, dims in tensors) if tensors else None
    arch = architecture or str(raw.get("model_type") or "")
    context = raw.get("max_position_embeddings")
    embedding = raw.get("hidden_size")
    metadata: dict[str, Any] = {"general.architecture": arch}
    if parameters is not None:
        metadata["general.parameter_count"] = parameters
    if isinstance(context, int):
        metadata[f"{arch}.context_length"] = context
    if isinstance(embedding, int):
        metadata[f"{arch}.embedding_length"] = embedding
    dtype = raw.get("torch_dtype") or raw.get("dtype") or ""
    facts = _with_family(
        arch,
        template if isinstance(template, str) else None,
        parameter_count=parameters,
        quantization=str(dtype).replace("bfloat16", "BF16").replace("float16", "F16").upper(),
        context_length=context if isinstance(context, int) else None,
        embedding_length=embedding if isinstance(embedding, int) else None,
        metadata=metadata,
    )
    # Gemma 3 4B and up: a "gemma3" folder with a vision_config reads images (its family is
    # text's too, 1B and the GGUFs without an mmproj).
    if raw.get("model_type") == "gemma3" and "vision_config" in raw:
        return dataclasses.replace(facts, vision=True)
    return facts


def _with_family(arch: str, template: str | None, **facts: Any) -> ModelFacts:
    """The facts with what the family record adds: its template when the files carry none,
    reasoning and vision; an architecture no record covers has neither."""
    try:
        family = family_for_model(arch, template)
    except ValueError:
        return ModelFacts(chat_template=template, reasoning=False, vision=False, **facts)
    return ModelFacts(
        chat_template=template or family.chat_template,
        reasoning=family.reasoning_markers is not None,
        vision=family.vision,
        **facts,
    )
