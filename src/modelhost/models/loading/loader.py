"""Resolve a model name to files and load it: network, tokenizer, config, family.

Weights are read tensor by tensor into the form they are served in (loading/weights.py), never
held as a whole model in fp32. What is slow to derive from a GGUF (its metadata, the tokenizer
transformers converts from it, its weights repacked for the native kernels: loading/
packed_cache.py) is kept under `MODELHOST_HOME/cache/gguf/<file>-<digest>/`, so a warm load
maps the packed weights and reads the rest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer as TokenizerBackend

from modelhost.models.config import ModelConfig
from modelhost.models.families import Family, family_for_model
from modelhost.models.loaded import LoadedModel
from modelhost.models.loading.embedded import DEFAULT_MODEL, embedded_path
from modelhost.models.loading.gguf_header import GGUFFile
from modelhost.models.loading.hf_config import config_from_hf, read_json
from modelhost.models.loading.load_gguf import FileReader, gguf_tensors
from modelhost.models.loading.load_safetensors import safetensors_tensors
from modelhost.models.loading.packed_cache import PackedCache
from modelhost.models.loading.quant import describe
from modelhost.models.loading.tokenizer_files import parsed_ahead, read_tokenizer_file
from modelhost.models.loading.weights import (
    Progress,
    TensorSource,
    WeightPlan,
    fill_checkpoint_modules,
    fill_network,
)
from modelhost.models.modes import MODES, default_mode
from modelhost.models.networks.decoder import DecoderLM
from modelhost.models.networks.gemma import build_gemma
from modelhost.models.networks.layers import partial_rotary_rows
from modelhost.models.networks.llama import build_llama
from modelhost.models.vision.load import UnsupportedProjector, hf_tower, mmproj_tower
from modelhost.models.vision.pairing import mmproj_beside
from modelhost.models.vision.tower import VisionTower
from modelhost.paths import file_cache_key, gguf_cache_root, modelhost_home
from modelhost.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

_GEN_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty")
_CACHE_VERSION = 3  # meta.json's layout


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


def load_model(
    name: str | None = None,
    *,
    device: torch.device | None = None,
    quantize: str | None = None,
    prepare: bool = True,
    progress: Progress | None = None,
    mmproj: Path | None = None,
) -> LoadedModel:
    """`quantize`: how CPU linears hold their weights (loading/quant.py's modes); `prepare=False`
    keeps the checkpoint's own modules, dense fp32 (what a converter writes out). `progress` is
    called with the fraction of the weights loaded, as they load. `mmproj`: a GGUF's vision
    projector, where it is not an `mmproj*.gguf` beside the model (models/vision/load.py)."""
    started = time.perf_counter()
    source = resolve(name)
    device = device or default_device()
    mode = quantize or default_mode()
    if mode not in MODES:
        raise ValueError(f"unknown quantization mode '{mode}' (one of {', '.join(MODES)})")
    # fp32 on CPUs: dense weights there are the reference path; bf16 on CUDA.
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    plan = WeightPlan(mode if prepare else "none", device, dtype)
    if source.is_gguf:
        model = _load_gguf(source, plan, prepare, progress, mmproj)
    else:
        model = _load_hf_dir(source, plan, prepare, progress)
    if plan.kernels is not None:
        # Decode attention reads every cached key and value each step (SmolLM2, 8 rows at
        # ~340 positions: 125 MB of fp32 a step); fp16 halves that. `none` stays the
        # reference maths, so it keeps fp32.
        model.kv_dtype = torch.float16
    model.load_seconds = time.perf_counter() - started
    ahead = "; its tokenizer parsed ahead" if parsed_ahead(model.tokenizer.backend) else ""
    log.info(
        "loaded %s in %.2f s: %.0f MB of weights (%s)%s",
        source.id, model.load_seconds, model.weights_bytes / 1e6, describe(model.network) or mode,
        ahead,
    )  # fmt: skip
    return model


def tokenizer_file(path: Path) -> Path | None:
    """The tokenizer file a load of the model at `path` parses, where it has one: a Hugging
    Face directory's, or the one converted from a GGUF file's vocabulary by an earlier load."""
    if path.suffix == ".gguf":
        cache = _cache_dir(path)
        if not _is_current(read_json(cache / "meta.json")):
            return None
        found = cache / "tokenizer.json"
    else:
        found = path / "tokenizer.json"
    return found if found.is_file() else None


def _is_current(meta: dict[str, Any]) -> bool:
    """Whether a GGUF's cached meta.json (and the tokenizer.json beside it) is this version's."""
    return meta.get("version") == _CACHE_VERSION


def _cache_dir(path: Path) -> Path:
    """Where a GGUF's metadata, converted tokenizer and packed weights are kept."""
    return gguf_cache_root() / file_cache_key(path)


def _forget_fp32_conversion(path: Path) -> None:
    """Removes what earlier versions cached for this file: the whole model dequantized to fp32
    (4 bytes a parameter on disk)."""
    old = modelhost_home() / "cache" / file_cache_key(path)
    if (old / "weights.safetensors").is_file():
        log.info("removing %s, an fp32 copy of %s that earlier versions cached", old, path.name)
        shutil.rmtree(old, ignore_errors=True)


def _load_gguf(
    source: ModelSource,
    plan: WeightPlan,
    prepare: bool,
    progress: Progress | None,
    mmproj: Path | None = None,
) -> LoadedModel:
    cache = _cache_dir(source.path)
    meta = read_json(cache / "meta.json")
    cached = _is_current(meta)
    if not cached:
        meta = _read_gguf_metadata(source.path)
        _forget_fp32_conversion(source.path)
    config = ModelConfig.from_json(meta["config"])
    # The tokenizer is read (or converted) on a thread while the weights are repacked: the
    # repack runs in native code without the GIL, so a conversion's Python overlaps it. A
    # cached tokenizer.json does not: `tokenizers` parses it holding the GIL throughout (a 1B
    # Llama file's ~0.3 s; Gemma 3's 262k tokens and 515k merges ~1 s of a switch to it),
    # unless the fork server parsed it ahead for this process (tokenizer_files.py).
    with ThreadPoolExecutor(1, thread_name_prefix="tokenizer") as pool:
        if cached:
            reading = pool.submit(read_tokenizer_file, cache / "tokenizer.json")
        else:
            reading = pool.submit(_gguf_tokenizer, source.path)
        reader = FileReader(source.path)
        kernels = plan.kernels if prepare else None
        packed = PackedCache.open(cache, kernels.build, plan.mode) if kernels else None
        try:
            sources = gguf_tensors(meta["tensors"], meta["architecture"], config, reader)
            network = _network(config, sources, plan, prepare, progress, packed)
        finally:
            reader.release()
        backend = reading.result()
    if not cached:
        _write_cache(cache, meta, backend)
    if packed is not None:
        packed.save_later()  # into the folder _write_cache makes
    family = family_for_model(meta["architecture"], meta["chat_template"], _has(backend))
    tokenizer = _tokenizer(
        backend,
        family,
        template=meta["chat_template"],
        eos_ids=set(meta["eos_token_ids"]),
        add_bos=meta["add_bos_token"],
        bos_token=meta["bos_token"],
        eos_token=meta["eos_token"],
    )
    tower = _gguf_tower(source.path, mmproj, plan, backend) if prepare else None
    return _loaded(source, config, family, tokenizer, network, plan, {}, tower)


def _gguf_tower(
    model: Path, named: Path | None, plan: WeightPlan, backend: TokenizerBackend
) -> VisionTower | None:
    """The vision tower of the mmproj file named, or else found beside the model. One found
    (not named) that cannot be served leaves the model text-only, with a warning."""
    path = named or mmproj_beside(model)
    if path is None:
        return None
    try:
        return mmproj_tower(path, plan, backend.token_to_id)
    except (UnsupportedProjector, ValueError) as exc:
        if named is not None:
            raise
        log.warning("%s: not using %s for images (%s)", model.name, path.name, exc)
        return None


def _read_gguf_metadata(path: Path) -> dict[str, Any]:
    """Parse the GGUF's header once: config, tensor table and chat settings (its tokenizer is
    `_gguf_tokenizer`'s)."""
    gguf_file = GGUFFile(path)
    config = gguf_file.config()
    tokens = gguf_file.field("tokenizer.ggml.tokens")
    eos_ids = {int(gguf_file.field("tokenizer.ggml.eos_token_id", -1))}
    eot = gguf_file.field("tokenizer.ggml.eot_token_id")
    if eot is not None:
        eos_ids.add(int(eot))
    bos_id = gguf_file.field("tokenizer.ggml.bos_token_id")
    meta = {
        "version": _CACHE_VERSION,
        "config": asdict(config),
        "architecture": gguf_file.architecture,
        "tensors": gguf_file.tensors,
        "chat_template": gguf_file.field("tokenizer.chat_template"),
        "eos_token_ids": sorted(i for i in eos_ids if i >= 0),
        "add_bos_token": bool(gguf_file.field("tokenizer.ggml.add_bos_token", False)),
        "bos_token": tokens[int(bos_id)] if bos_id is not None else None,
        "eos_token": tokens[min(eos_ids)] if min(eos_ids) >= 0 else None,
    }
    return meta


def _gguf_tokenizer(path: Path) -> TokenizerBackend:
    """transformers' conversion of the file's vocabulary, asked for directly: AutoTokenizer
    first parses the whole header with gguf's reader only to pick a tokenizer class (Gemma 3's
    262k-token vocabulary: 14.8 s against 3.7 s; SmolLM2's 3.8 against 0.5). The result is the
    same tokenizer, special tokens and post-processor included."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            convert_gguf_tokenizer,
            get_gguf_tokenizer,
        )
    except ImportError:  # a transformers without it (before 5.x): the long way
        found = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        return found.backend_tokenizer
    architecture, vocabulary, settings = get_gguf_tokenizer(str(path))
    backend, _ = convert_gguf_tokenizer(architecture, vocabulary)
    settings.pop("chat_template", None)  # the loader reads it from the file itself
    return PreTrainedTokenizerFast(tokenizer_object=backend, **settings).backend_tokenizer


def _write_cache(cache: Path, meta: dict[str, Any], backend: TokenizerBackend) -> None:
    """Keeps the parsed metadata for the next load; a home that cannot be written only costs
    that load the parsing again."""
    partial = cache.with_name(cache.name + f".partial-{os.getpid()}")
    try:
        partial.mkdir(parents=True, exist_ok=True)
        backend.save(str(partial / "tokenizer.json"))
        (partial / "meta.json").write_text(json.dumps(meta))
        shutil.rmtree(cache, ignore_errors=True)  # an earlier version's layout
        partial.replace(cache)
    except OSError as exc:
        log.warning("cannot cache %s's metadata in %s (%s)", cache.name, cache.parent, exc)
        shutil.rmtree(partial, ignore_errors=True)


def _network(
    config: ModelConfig,
    sources: Mapping[str, TensorSource],
    plan: WeightPlan,
    prepare: bool,
    progress: Progress | None,
    packed: PackedCache | None = None,
) -> DecoderLM:
    with torch.device("meta"), _without_initialisation():
        network = build_network(config)
    if config.rope_dim is not None:
        sources = _partial_rotary_layout(config, sources)
    if prepare:
        fill_network(network, sources, plan, progress, packed)
    else:
        fill_checkpoint_modules(network, sources, progress)
    return network


def _load_hf_dir(
    source: ModelSource, plan: WeightPlan, prepare: bool, progress: Progress | None
) -> LoadedModel:
    raw = read_json(source.path / "config.json")
    config = config_from_hf(raw)
    settings = read_json(source.path / "tokenizer_config.json")
    template_file = source.path / "chat_template.jinja"
    # Multimodal folders (SmolVLM) keep the processor's template in chat_template.json.
    template = settings.get("chat_template") or read_json(source.path / "chat_template.json").get(
        "chat_template"
    )
    if template_file.is_file():
        template = template_file.read_text()
    if not isinstance(template, str):
        template = None  # a list of named templates (rare): the family's default
    backend = _hf_tokenizer_backend(source.path)
    family = family_for_model(
        str(raw.get("model_type") or config.architecture), template, _has(backend)
    )
    sources = safetensors_tensors(source.path, config)
    network = _network(config, sources, plan, prepare, progress)
    tower = hf_tower(source.path, raw, sources, plan, backend.token_to_id) if prepare else None
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
        template=template,
        eos_ids=eos_ids,
        add_bos=bool(add_bos),
        bos_token=bos,
        eos_token=eos,
    )
    defaults = _gen_defaults(generation)
    return _loaded(source, config, family, tokenizer, network, plan, defaults, tower)


def _hf_tokenizer_backend(directory: Path) -> TokenizerBackend:
    if (directory / "tokenizer.json").is_file():
        return read_tokenizer_file(directory / "tokenizer.json")
    from transformers import AutoTokenizer  # sentencepiece-only checkpoints: convert

    return AutoTokenizer.from_pretrained(str(directory)).backend_tokenizer


def _has(backend: TokenizerBackend) -> Callable[[str], bool]:
    """Whether the vocabulary holds a token (the family's dialect check asks a few)."""
    return lambda token: backend.token_to_id(token) is not None


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
    plan: WeightPlan,
    gen_defaults: dict[str, float],
    vision: VisionTower | None = None,
) -> LoadedModel:
    return LoadedModel(
        id=source.id,
        path=source.path,
        config=config,
        # A family reads images exactly when a tower was loaded for this model.
        family=dataclasses.replace(family, vision=vision is not None),
        tokenizer=tokenizer,
        network=network,
        device=plan.device,
        dtype=plan.dtype,
        weights_bytes=_weights_bytes(network) + _weights_bytes(vision),
        gen_defaults=gen_defaults,
        vision=vision,
    )


@contextlib.contextmanager
def _without_initialisation() -> Iterator[None]:
    """Module constructors skip their random initialisation: on the meta device it computes
    nothing, but the first call imports torch._dynamo (seconds, in every worker process)."""
    saved = {name: getattr(torch.nn.init, name) for name in _INITIALISERS}
    for name in _INITIALISERS:
        setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(torch.nn.init, name, function)


_INITIALISERS = ("uniform_", "normal_", "kaiming_uniform_", "zeros_", "ones_")


def build_network(config: ModelConfig) -> DecoderLM:
    return build_gemma(config) if config.architecture == "gemma" else build_llama(config)


def _partial_rotary_layout(
    config: ModelConfig, sources: Mapping[str, TensorSource]
) -> Mapping[str, TensorSource]:
    """Reorders q and k rows so a partial rotary is a whole-head one (layers.Rotary)."""
    assert config.rope_dim is not None
    if config.qk_norm:  # its per-dimension weights would need the same order
        raise ValueError("partial rotary with q/k norms is not supported")
    dim = config.head_dim
    q_rows = partial_rotary_rows(config.num_heads, dim, config.rope_dim)
    k_rows = partial_rotary_rows(config.num_kv_heads, dim, config.rope_dim)
    heads, kv_heads = config.num_heads, config.num_kv_heads
    values = torch.arange((heads + kv_heads) * dim, (heads + 2 * kv_heads) * dim)
    qkv_rows = torch.cat((q_rows, heads * dim + k_rows, values))
    wanted = {"q_proj": q_rows, "k_proj": k_rows, "qkv_proj": qkv_rows}
    for name, source in sources.items():
        stem, _, kind = name.rpartition(".")
        rows = wanted.get(stem.rpartition(".")[2])
        if rows is not None and kind in ("weight", "bias"):
            source.order = rows if source.order is None else source.order[rows]
    return sources


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
        markup_tokens=family.markup_tokens,
    )


def _gen_defaults(generation: dict[str, Any]) -> dict[str, float]:
    return {
        key: float(generation[key])
        for key in _GEN_DEFAULT_KEYS
        if isinstance(generation.get(key), int | float) and not isinstance(generation[key], bool)
    }


def _weights_bytes(network: torch.nn.Module | VisionTower | None) -> int:
    """Bytes of the network's tensors, each counted once (a tied head shares the embedding's);
    a vision tower's where it is a module (every tower here is)."""
    if not isinstance(network, torch.nn.Module):
        return 0
    seen: set[int] = set()
    total = 0
    for tensor in itertools.chain(network.parameters(), network.buffers()):
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total
