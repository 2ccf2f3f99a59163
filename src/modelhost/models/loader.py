"""Resolve a model name to files and load it: network, tokenizer, config, family.

Slow derivations (GGUF tokenizer conversion, dequantization) are done once and cached under
`MODELHOST_HOME/cache/<file>-<digest>/`, so a warm load is a memory map and a tokenizer.json.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer as TokenizerBackend

from modelhost.models import native
from modelhost.models.config import ModelConfig
from modelhost.models.decoder import DecoderLM
from modelhost.models.embedded import DEFAULT_MODEL, embedded_path
from modelhost.models.families import Family, family_for
from modelhost.models.gemma3 import build_gemma3
from modelhost.models.llama import build_llama
from modelhost.models.load_gguf import GGUFFile
from modelhost.models.load_safetensors import config_from_hf, read_json, state_dict_from_dir
from modelhost.models.loaded import LoadedModel
from modelhost.models.quant import prepare_for_inference
from modelhost.paths import modelhost_home
from modelhost.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

_GEN_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty")
# CPU linears: see models/quant.py and benchmarks/README.md for the measured choice.
DEFAULT_QUANTIZE = "auto"


class ModelNotFound(LookupError):
    pass


@dataclass(frozen=True, slots=True)
class ModelSource:
    id: str
    path: Path  # a .gguf file or a Hugging Face directory

    @property
    def is_gguf(self) -> bool:
        return self.path.suffix == ".gguf"


def resolve(name: str | None) -> ModelSource:
    """An embedded id, a .gguf file or a Hugging Face directory."""
    name = name or DEFAULT_MODEL
    embedded = embedded_path(name)
    if embedded is not None:
        return ModelSource(name, embedded)
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path.stem, path)
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(path.name, path)
    raise ModelNotFound(f"model '{name}' not found")


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_quantize() -> str:
    """`MODELHOST_QUANTIZE` (none, int8, auto, int4; see models/quant.py), else the default."""
    return os.environ.get("MODELHOST_QUANTIZE") or DEFAULT_QUANTIZE


def load_model(
    name: str | None = None,
    *,
    device: torch.device | None = None,
    quantize: str | None = None,
    prepare: bool = True,
) -> LoadedModel:
    """`quantize` applies on CPUs only (weight-only int8/int4 linears, models/quant.py);
    `prepare=False` keeps the checkpoint's own modules (what a converter writes out)."""
    started = time.perf_counter()
    source = resolve(name)
    device = device or default_device()
    # fp32 on CPUs: these have no bf16 instructions, and bf16 matmuls measured slower here.
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if source.is_gguf:
        model = _load_gguf(source, device, dtype)
    else:
        model = _load_hf_dir(source, device, dtype)
    if prepare and device.type == "cpu":
        mode = quantize or default_quantize()
        prepare_for_inference(model.network, mode)
        model.weights_bytes = _weights_bytes(model.network)
        if mode != "none" and native.kernels() is not None:
            # Decode attention reads every cached key and value each step (SmolLM2, 8 rows at
            # ~340 positions: 125 MB of fp32 a step); fp16 halves that. `none` stays the
            # reference maths, so it keeps fp32.
            model.kv_dtype = torch.float16
    model.load_seconds = time.perf_counter() - started
    log.info("loaded %s in %.2f s", source.id, model.load_seconds)
    return model


def _cache_dir(path: Path) -> Path:
    stat = path.stat()
    digest = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    return modelhost_home() / "cache" / f"{path.stem}-{digest.hexdigest()[:12]}"


def _load_gguf(source: ModelSource, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    cache = _cache_dir(source.path)
    meta = read_json(cache / "meta.json")
    if meta:
        return _load_converted(source, cache, meta, device, dtype)
    try:
        meta = _convert_gguf(source.path, cache)  # cold: minutes of parsing, done once
    except OSError as exc:  # MODELHOST_HOME is read-only or full: convert for this load only
        log.warning("cannot write %s (%s); converting %s into a temporary folder", cache, exc,
                    source.path)  # fmt: skip
        with tempfile.TemporaryDirectory(prefix="modelhost-gguf-") as scratch:
            converted = Path(scratch) / cache.name
            meta = _convert_gguf(source.path, converted)
            return _load_converted(source, converted, meta, device, dtype)
    return _load_converted(source, cache, meta, device, dtype)


def _load_converted(
    source: ModelSource,
    cache: Path,
    meta: dict[str, Any],
    device: torch.device,
    dtype: torch.dtype,
) -> LoadedModel:
    config = ModelConfig(**meta["config"])
    family = family_for(meta["architecture"])
    state = load_file(str(cache / "weights.safetensors")).items()
    network = _build_network(config, state, device, dtype)
    tokenizer = _tokenizer(
        TokenizerBackend.from_file(str(cache / "tokenizer.json")),
        family,
        template=meta["chat_template"],
        eos_ids=set(meta["eos_token_ids"]),
        add_bos=meta["add_bos_token"],
        bos_token=meta["bos_token"],
        eos_token=meta["eos_token"],
    )
    return _loaded(source, config, family, tokenizer, network, device, dtype, {})


def _convert_gguf(path: Path, cache: Path) -> dict[str, Any]:
    """Parse the GGUF once: dequantized weights, tokenizer.json and metadata into `cache`."""
    from transformers import AutoTokenizer

    gguf_file = GGUFFile(path)
    config = gguf_file.config()
    partial = cache.with_name(cache.name + f".partial-{os.getpid()}")
    partial.mkdir(parents=True, exist_ok=True)
    save_file(dict(gguf_file.state_dict(config)), str(partial / "weights.safetensors"))
    hf_tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    hf_tokenizer.backend_tokenizer.save(str(partial / "tokenizer.json"))
    tokens = gguf_file.field("tokenizer.ggml.tokens")
    eos_ids = {int(gguf_file.field("tokenizer.ggml.eos_token_id", -1))}
    eot = gguf_file.field("tokenizer.ggml.eot_token_id")
    if eot is not None:
        eos_ids.add(int(eot))
    bos_id = gguf_file.field("tokenizer.ggml.bos_token_id")
    meta = {
        "config": asdict(config),
        "architecture": gguf_file.architecture,
        "chat_template": gguf_file.field("tokenizer.chat_template"),
        "eos_token_ids": sorted(i for i in eos_ids if i >= 0),
        "add_bos_token": bool(gguf_file.field("tokenizer.ggml.add_bos_token", False)),
        "bos_token": tokens[int(bos_id)] if bos_id is not None else None,
        "eos_token": tokens[min(eos_ids)] if min(eos_ids) >= 0 else None,
    }
    (partial / "meta.json").write_text(json.dumps(meta))
    cache.parent.mkdir(parents=True, exist_ok=True)
    try:
        partial.replace(cache)
    except OSError:  # another process converted it first; use theirs
        shutil.rmtree(partial, ignore_errors=True)
    return meta


def _load_hf_dir(source: ModelSource, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    raw = read_json(source.path / "config.json")
    config = config_from_hf(raw)
    family = family_for(str(raw.get("model_type") or config.architecture))
    network = _build_network(config, state_dict_from_dir(source.path, config), device, dtype)
    settings = read_json(source.path / "tokenizer_config.json")
    template_file = source.path / "chat_template.jinja"
    template = settings.get("chat_template")
    if template_file.is_file():
        template = template_file.read_text()
    backend = _hf_tokenizer_backend(source.path)
    bos, eos = _token_text(settings.get("bos_token")), _token_text(settings.get("eos_token"))
    generation = read_json(source.path / "generation_config.json")
    eos_value = generation.get("eos_token_id", raw.get("eos_token_id"))
    eos_ids = set(eos_value if isinstance(eos_value, list) else [eos_value] if eos_value else [])
    if eos is not None and backend.token_to_id(eos) is not None:
        eos_ids.add(backend.token_to_id(eos))
    add_bos = settings.get("add_bos_token")
    if add_bos is None and bos is not None:  # the post-processor decides; ask it
        add_bos = backend.encode("a").ids[:1] == [backend.token_to_id(bos)]
    tokenizer = _tokenizer(
        backend,
        family,
        template=template if isinstance(template, str) else None,
        eos_ids=eos_ids,
        add_bos=bool(add_bos),
        bos_token=bos,
        eos_token=eos,
    )
    return _loaded(
        source, config, family, tokenizer, network, device, dtype, _gen_defaults(generation)
    )


def _hf_tokenizer_backend(directory: Path) -> TokenizerBackend:
    if (directory / "tokenizer.json").is_file():
        return TokenizerBackend.from_file(str(directory / "tokenizer.json"))
    from transformers import AutoTokenizer  # sentencepiece-only checkpoints: convert

    return AutoTokenizer.from_pretrained(str(directory)).backend_tokenizer


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _loaded(
    source: ModelSource,
    config: ModelConfig,
    family: Family,
    tokenizer: Tokenizer,
    network: DecoderLM,
    device: torch.device,
    dtype: torch.dtype,
    gen_defaults: dict[str, float],
) -> LoadedModel:
    return LoadedModel(
        id=source.id,
        path=source.path,
        config=config,
        family=family,
        tokenizer=tokenizer,
        network=network,
        device=device,
        dtype=dtype,
        weights_bytes=_weights_bytes(network),
        gen_defaults=gen_defaults,
    )


def build_network(config: ModelConfig) -> DecoderLM:
    return build_gemma3(config) if config.architecture == "gemma3" else build_llama(config)


def _build_network(
    config: ModelConfig,
    state: Iterable[tuple[str, torch.Tensor]],
    device: torch.device,
    dtype: torch.dtype,
) -> DecoderLM:
    with torch.device("meta"):
        network = build_network(config)
    expected = set(network.state_dict())
    loaded = {
        name: value.to(device=device, dtype=dtype) for name, value in state if name in expected
    }
    if config.tie_word_embeddings:
        loaded.pop("lm_head.weight", None)
        expected.discard("lm_head.weight")
    missing = expected - set(loaded)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
    network.load_state_dict(loaded, strict=False, assign=True)
    if config.tie_word_embeddings:
        network.lm_head.weight = network.model.embed_tokens.weight
    return network.eval()


def _tokenizer(
    backend: TokenizerBackend,
    family: Family,
    *,
    template: str | None,
    eos_ids: set[int],
    add_bos: bool,
    bos_token: str | None,
    eos_token: str | None,
) -> Tokenizer:
    for token in family.eos_tokens:
        token_id = backend.token_to_id(token)
        if token_id is not None:
            eos_ids.add(token_id)
    return Tokenizer(
        backend,
        chat_template=template or family.chat_template,
        eos_token_ids=eos_ids,
        add_bos_token=add_bos,
        bos_token=bos_token,
        eos_token=eos_token,
    )


def _gen_defaults(generation: dict[str, Any]) -> dict[str, float]:
    return {
        key: float(generation[key])
        for key in _GEN_DEFAULT_KEYS
        if isinstance(generation.get(key), int | float) and not isinstance(generation[key], bool)
    }


def _weights_bytes(network: torch.nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for param in itertools.chain(network.parameters(), network.buffers()):
        if id(param) not in seen:
            seen.add(id(param))
            total += param.numel() * param.element_size()
    return total
