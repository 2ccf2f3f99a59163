"""The local models: found on disk, named by stable ids, each with a byte estimate.

Places, in order (the first to claim an id keeps it):

- the embedded models that ship as package dependencies;
- paths given to `serve` (a .gguf file, a Hugging Face directory, or a folder of models);
- `MODELHOST_HOME/models`: loose .gguf files and Hugging Face directories (`name/` or `org/name/`);
- the Hugging Face cache where `huggingface_hub` keeps it (`HF_HUB_CACHE`, `HF_HOME/hub`,
  `XDG_CACHE_HOME/huggingface/hub`, else ~/.cache/huggingface/hub):
  `models--org--name/snapshots/<rev>/`, the revision `refs/main` names (else the newest).

Ids: `org/name` for Hugging Face layouts, the file stem for GGUF, the embedded ids as they are;
a model in the hub cache also answers to the name a pull took (`hf.co/org/name:QUANT`).
Besides generative models, an entry may be a sentence encoder (a BERT-family Hugging Face
directory: `operations=("embed",)`), a cross-encoder (one whose config.json's `architectures`
names a `...ForSequenceClassification`: `("rerank",)`), a decoder embedder or reranker (what
models/retrieval/retrieval_files.py reads from its files: `("embed",)`, `("rerank",)`) or a
faster-whisper model directory (`("transcribe",)`).
An id is only ever looked up among what a scan found, never turned into a path, and a file that
resolves outside its root (a symlink out of the models folder) is skipped. Files a pull is
still writing or checking (residency/pull/marker.py) are skipped too; a finished pull touches
the hub folder, which makes the next lookup of an unknown id rescan at once.

The estimate is what the model will hold once served and idle: its weights as the loader keeps
them (on CPUs each tensor packed in its file's own quantization, or the `--quantize` mode's;
bf16 on CUDA; loading/footprint.py's `held_bytes`) and the prefix cache an idle engine keeps
(IDLE_KV_BYTES at most). On CPUs the KV pool grows with use, so what requests need beyond that
is their *claim* (residency/unit.py's `claim_bytes`, counted by the host per lease): one
engine step's working memory (`work_bytes`), a full serving context of KV a row
(`kv_row_bytes`), and at most the pool's ceiling (`kv_pool_bytes`; under --memory-budget, all
the budget leaves beside the weights), and, with the prefix KV store on, the bound of its
writer's queue (`store_queue_bytes`: blocks copied out of the pool for the disk). On CUDA the
pool is preallocated: the estimate holds it, the working memory and that queue, and nothing is
claimed. A checkpoint holding a tensor the kernels
cannot run (an IQ quantization, say) is listed with the reason it is refused.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from modelhost.engine.kv.kv_format import kv_token_bytes
from modelhost.engine.kv.kv_pool_size import (
    BLOCK_TOKENS,
    IDLE_KV_BYTES,
    default_kv_bytes,
    store_queue_bytes,
)
from modelhost.inference.admission import budget_window, working_bytes
from modelhost.models.config import ModelConfig
from modelhost.models.families import family_for
from modelhost.models.loading import footprint
from modelhost.models.loading.embedded import EMBEDDED, EMBEDDED_ENCODERS
from modelhost.models.loading.footprint import held_bytes, unsupported_tensor
from modelhost.models.loading.gguf_header import GGUFFile
from modelhost.models.loading.hf_config import config_from_hf, read_json
from modelhost.models.networks.cross_encoder_config import cross_encoder_refusal, is_cross_encoder
from modelhost.models.networks.encoder_files import (
    GGUF_ENCODER_ARCHITECTURES,
    embedding_refusal,
    gguf_encoder_kind,
)
from modelhost.models.retrieval.retrieval_files import (
    Retrieval,
    folder_retrieval,
    forward_work_bytes,
    gguf_retrieval,
)
from modelhost.models.vision.pairing import is_mmproj, mmproj_beside, reads_images
from modelhost.paths import file_cache_key, modelhost_home
from modelhost.residency.pull.marker import files_being_pulled
from modelhost.residency.pull.plan import quant_files
from modelhost.residency.pull.reference import PullError, parse_reference

log = logging.getLogger(__name__)

_RESCAN_S = 5.0  # an unknown id rescans the disk at most this often (clients send aliases)
# A companion's working memory beyond its weights: padded encoder batches; Whisper's int8 copy
# of its weights, beam state and audio features (~400 MB resident for base's 145 MB file).
_ENCODER_WORK_BYTES = 128 << 20
_WHISPER_WORK_FACTOR = 2
_ENCODER_TYPES = frozenset({"bert", "roberta", "xlm-roberta", "distilbert", "nomic_bert"})


@dataclass(frozen=True, slots=True)
class ServingShape:
    """What the estimate assumes about how a model will be served."""

    dtype_bytes: int = 4  # activations: fp32 on CPU, 2 (bf16) on CUDA
    batch: int = 8
    chunk_tokens: int = 512
    context_length: int | None = None  # --context-length
    memory_budget_bytes: int | None = None  # --memory-budget: the KV pool fills it
    quantize: str = "auto"  # --quantize (models/loading/quant.py's modes)
    kv_store: bool = False  # --kv-disk above 0: the engine copies full blocks out for the disk
    # The residency budget a model's default window fills (--model-budget; None: the trained
    # length), and how the KV pool holds keys and values (--kv-cache, engine/kv/kv_format.py).
    model_budget_bytes: int | None = None
    kv_cache: str = "f16"

    @property
    def cuda(self) -> bool:
        return self.dtype_bytes == 2

    @property
    def kv_dtype_bytes(self) -> int:
        """fp16 keys and values on CPUs (bf16 on CUDA), except the fp32 reference mode."""
        return 4 if self.quantize == "none" and not self.cuda else 2

    def kv_token_bytes(self, config: ModelConfig) -> int:
        """What a token's keys and values cost in the KV pool, in the --kv-cache format."""
        return kv_token_bytes(config, self.kv_dtype_bytes, self.kv_cache)


@dataclass(frozen=True, slots=True)
class ModelEntry:
    id: str
    path: Path  # a .gguf file or a Hugging Face directory
    format: str  # "gguf" or "safetensors"
    architecture: str | None
    size_bytes: int  # on disk
    weights_bytes: int  # as loaded
    estimate_bytes: int  # held when served and idle (module docstring)
    embedded: bool = False
    operations: tuple[str, ...] = ("generate",)
    refusal: str | None = None  # why it cannot be served (a tensor type the kernels lack)
    work_bytes: int = 0  # claimed by a busy model: one step's working memory
    kv_row_bytes: int = 0  # claimed a lease: a full context of KV
    kv_pool_bytes: int = 0  # the most all leases together claim of KV
    store_queue_bytes: int = 0  # claimed by a busy model: the KV store writer's queue bound
    # A GGUF's vision projector named by `serve --mmproj` (one beside it needs no name).
    mmproj: Path | None = None
    # The window it would be served at, known without loading it: its own, or --context-length
    # when smaller (a --memory-budget may cap it further once it loads).
    context_length: int | None = None


def with_draft(entry: ModelEntry, draft: ModelEntry) -> ModelEntry:
    """`entry` served with `draft` guessing ahead beside it (--draft-model): the draft's
    weights, working memory and KV count in what the unit holds and claims."""
    return replace(
        entry,
        estimate_bytes=entry.estimate_bytes + draft.estimate_bytes,
        work_bytes=entry.work_bytes + draft.work_bytes,
        kv_row_bytes=entry.kv_row_bytes + draft.kv_row_bytes,
        kv_pool_bytes=entry.kv_pool_bytes + draft.kv_pool_bytes,
    )


def hf_hub_dir() -> Path:
    """The Hugging Face cache as `huggingface_hub` places it (HF_HUB_CACHE, the older
    HUGGINGFACE_HUB_CACHE, HF_HOME/hub, XDG_CACHE_HOME/huggingface/hub, ~/.cache/...), read
    from the environment at each call, so a pull lands where every other tool looks."""
    env = os.environ
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if not cache:
        xdg = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        cache = os.path.join(env.get("HF_HOME") or os.path.join(xdg, "huggingface"), "hub")
    return Path(os.path.expandvars(os.path.expanduser(cache)))


class ModelRegistry:
    def __init__(
        self,
        paths: Sequence[str | Path] = (),
        *,
        home: Path | None = None,
        hf_hub: Path | None = None,
        embedded: bool = True,
        shape: ServingShape | None = None,
    ) -> None:
        self.paths = [Path(p).expanduser() for p in paths]
        self.home_models = (home or modelhost_home()) / "models"
        self.hf_hub = hf_hub if hf_hub is not None else hf_hub_dir()
        self.embedded = embedded
        self.shape = shape or ServingShape()
        # by file signature (and the mmproj named for it)
        self._read: dict[tuple[Path, int, int, Path | None], ModelEntry | None] = {}
        self._entries: dict[str, ModelEntry] = {}
        self._scanned_at: float | None = None
        self._hub_signature: int | None = None  # the hub folder's mtime at the last scan
        self._named_mmproj: dict[Path, Path] = {}  # a GGUF's (resolved) path -> its mmproj

    def entries(self) -> list[ModelEntry]:
        """Every local model, scanning the disk again."""
        self.scan()
        return list(self._entries.values())

    def get(self, model_id: str) -> ModelEntry | None:
        """The entry of an exact local id, or of the name a pull took (`pulled`); an id not
        seen yet may trigger a rescan."""
        stale = self._scanned_at is None or time.monotonic() - self._scanned_at > _RESCAN_S
        if model_id not in self._entries and (stale or self._hub_changed()):
            self.scan()
        return self._entries.get(model_id) or self.pulled(model_id)

    def pulled(self, name: str) -> ModelEntry | None:
        """The model in the hub cache that a pull's name means (`hf.co/USER/REPO:Q4_K_M`, as
        Ollama names what it pulls from the hub): the repo's GGUF file of that quantization,
        or its safetensors folder."""
        if "/" not in name:
            return None
        try:
            reference = parse_reference(name)
        except PullError:
            return None
        repo_dir = self.hf_hub / f"models--{reference.repo_id.replace('/', '--')}"
        inside = [e for e in self._entries.values() if e.path.is_relative_to(repo_dir)]
        ggufs = {e.path.name: e for e in inside if e.format == "gguf"}
        picked = quant_files(list(ggufs), reference.quant)
        if picked:
            return ggufs[picked[0]]
        if reference.quant is None:
            return next((e for e in inside if e.format != "gguf"), None)
        return None

    def scan(self) -> None:
        found: dict[str, ModelEntry] = {}
        seen: set[Path] = set()
        for entry in self._discover():
            real = entry.path.resolve()
            if entry.id in found or real in seen:
                continue
            found[entry.id] = entry
            seen.add(real)
        self._entries, self._scanned_at = found, time.monotonic()
        self._hub_signature = _mtime_ns(self.hf_hub)

    def _hub_changed(self) -> bool:
        return _mtime_ns(self.hf_hub) != self._hub_signature

    def resolve_argument(self, name: str, mmproj: Path | None = None) -> ModelEntry | None:
        """A `serve` argument: a local id, or a path to a model (which joins the registry);
        `mmproj` names a GGUF's vision projector where none sits beside it."""
        entry = self._resolve(name)
        if entry is None or mmproj is None:
            return entry
        if entry.format != "gguf":
            raise ValueError(f"--mmproj goes with a GGUF model, not {entry.id}")
        self._named_mmproj[entry.path.resolve()] = mmproj.expanduser().resolve()
        self.scan()
        return self._entries.get(entry.id)

    def _resolve(self, name: str) -> ModelEntry | None:
        entry = self.get(name)
        if entry is not None:
            return entry
        path = Path(name).expanduser()
        if not path.exists():
            return None
        if path not in self.paths:
            self.paths.append(path)
        self.scan()
        real = path.resolve()
        for entry in self._entries.values():
            if entry.path.resolve() == real:
                return entry
        return None

    # -- discovery -------------------------------------------------------------------------

    def _discover(self) -> Iterator[ModelEntry]:
        if self.embedded:
            yield from self._embedded()
        for path in self.paths:
            if path.is_file() and path.suffix == ".gguf":
                yield from self._entry(path.stem, path, path.parent)
            elif (path / "config.json").is_file():
                yield from self._entry(path.name, path, path)
            elif path.is_dir():
                yield from self._folder(path)
        if self.home_models.is_dir():
            yield from self._folder(self.home_models)
        if self.hf_hub.is_dir():
            yield from self._hub(self.hf_hub)

    def _embedded(self) -> Iterator[ModelEntry]:
        for model_id, locate in {
            **EMBEDDED,
            **EMBEDDED_ENCODERS,
            **_embedded_transcribers(),
        }.items():
            try:
                path = locate()
            except Exception as exc:  # the package is missing or broken: not a local model
                log.debug("embedded model %s unavailable: %s", model_id, exc)
                continue
            for entry in self._entry(model_id, path, path.parent):
                yield _with(entry, embedded=True)

    def _folder(self, root: Path) -> Iterator[ModelEntry]:
        """Loose .gguf files and Hugging Face directories one or two levels down."""
        for child in sorted(root.iterdir()):
            if child.is_file() and child.suffix == ".gguf":
                yield from self._entry(child.stem, child, root)
            elif child.is_dir() and (child / "config.json").is_file():
                yield from self._entry(child.name, child, root)
            elif child.is_dir():
                for grandchild in sorted(child.iterdir()):
                    if grandchild.is_dir() and (grandchild / "config.json").is_file():
                        yield from self._entry(f"{child.name}/{grandchild.name}", grandchild, root)

    def _hub(self, hub: Path) -> Iterator[ModelEntry]:
        for repo in sorted(hub.glob("models--*--*")):
            org, _, name = repo.name.removeprefix("models--").partition("--")
            snapshot = _snapshot(repo)
            if snapshot is None:
                continue
            pulling = files_being_pulled(repo)
            if (snapshot / "config.json").is_file() and "config.json" not in pulling:
                yield from self._entry(f"{org}/{name}", snapshot, hub)
            for gguf_file in sorted(snapshot.glob("*.gguf")):
                if gguf_file.name not in pulling:
                    yield from self._entry(gguf_file.stem, gguf_file, hub)

    def _entry(self, model_id: str, path: Path, root: Path) -> Iterator[ModelEntry]:
        if not _inside(path, root):
            log.warning("skipping %s: it resolves outside %s", path, root)
            return
        try:
            stat = path.stat()
            key = (path, stat.st_size, stat.st_mtime_ns, self._named_mmproj.get(path.resolve()))
            if key not in self._read:
                self._read[key] = self._read_model(model_id, path, root)
            entry = self._read[key]
        except (OSError, ValueError, KeyError) as exc:
            log.warning("skipping %s: %s", path, exc)
            return
        if entry is not None:
            yield _with(entry, id=model_id)

    def _read_model(self, model_id: str, path: Path, root: Path) -> ModelEntry | None:
        if is_mmproj(path):  # a vision projector: part of the model beside it, not a model
            return None
        named: Path | None = None
        if path.suffix == ".gguf":
            try:
                config, architecture, tensors, size, pooling = _read_gguf(path)
            except UnservableArchitecture as exc:
                if exc.architecture in GGUF_ENCODER_ARCHITECTURES:
                    return _gguf_encoder(model_id, path)
                return _refused(model_id, path, "gguf", exc, path.stat().st_size)
            retrieval = gguf_retrieval(pooling, architecture, {t[0] for t in tensors})
            named = self._named_mmproj.get(path.resolve())
            mmproj = named or (mmproj_beside(path) if reads_images(path) else None)
            if mmproj is not None:  # its tower loads with it, and costs its file
                projector = GGUFFile(mmproj).tensors
                tensors = [
                    *tensors,
                    *((t["name"], t["type"], tuple(reversed(t["shape"]))) for t in projector),
                ]
                size += mmproj.stat().st_size
            fmt = "gguf"
        elif _is_whisper_dir(path):
            return self._transcriber(model_id, path)
        else:
            files = [f for f in sorted(path.glob("*.safetensors")) if _inside(f, root)]
            if not files:
                return None
            raw = read_json(path / "config.json")
            if raw.get("model_type") in _ENCODER_TYPES:
                return self._encoder(model_id, path, files, raw)
            size = sum(f.stat().st_size for f in files)
            try:
                architecture, config = hf_model_config(raw)
            except UnservableArchitecture as refusal:
                return _refused(model_id, path, "safetensors", refusal, size)
            tensors = [t for f in files for t in _safetensors_tensors(f)]
            fmt = "safetensors"
            retrieval = folder_retrieval(path, (model_id,), raw)
        shape = self.shape
        weights = held_bytes(((t[1], t[2]) for t in tensors), shape.quantize, cuda=shape.cuda)
        serving = serving_bytes(config, weights, shape)
        entry = ModelEntry(
            id=model_id,
            path=path,
            format=fmt,
            architecture=architecture,
            size_bytes=size,
            weights_bytes=weights,
            estimate_bytes=serving.estimate,
            refusal=unsupported_tensor((name, kind, len(dims)) for name, kind, dims in tensors),
            work_bytes=serving.work,
            kv_row_bytes=serving.kv_row,
            kv_pool_bytes=serving.kv_pool,
            store_queue_bytes=serving.store_queue,
            mmproj=named,
            context_length=serving_context(config, shape, weights),
        )
        return entry if retrieval is None else _retrieving(entry, config, retrieval)

    def _encoder(
        self, model_id: str, path: Path, files: list[Path], raw: dict[str, Any]
    ) -> ModelEntry:
        tensors = [t for f in files for t in _safetensors_tensors(f)]
        weights = sum(math.prod(dims) for _, _, dims in tensors) * 4  # encoders run in fp32
        reranks = is_cross_encoder(raw)
        return ModelEntry(
            id=model_id,
            path=path,
            format="safetensors",
            architecture=str(raw.get("model_type")),
            size_bytes=sum(f.stat().st_size for f in files),
            weights_bytes=weights,
            estimate_bytes=weights + _ENCODER_WORK_BYTES,
            operations=("rerank",) if reranks else ("embed",),
            refusal=cross_encoder_refusal(raw) if reranks else embedding_refusal(path, raw),
        )

    def _transcriber(self, model_id: str, path: Path) -> ModelEntry:
        size = (path / "model.bin").stat().st_size
        return ModelEntry(
            id=model_id,
            path=path,
            format="ctranslate2",
            architecture="whisper",
            size_bytes=size,
            weights_bytes=size,
            estimate_bytes=size * (1 + _WHISPER_WORK_FACTOR),
            operations=("transcribe",),
        )


def _gguf_encoder(model_id: str, path: Path) -> ModelEntry:
    """A BERT-family GGUF (llama.cpp's "bert"): an embedder, or a reranker with its classifier
    head; its tensors run in fp32."""
    gguf_file = GGUFFile(path)
    operation, refusal = gguf_encoder_kind(
        gguf_file.arch_field("pooling_type"),
        gguf_file.field("tokenizer.ggml.model"),
        {t["name"] for t in gguf_file.tensors},
    )
    weights = sum(math.prod(t["shape"]) for t in gguf_file.tensors) * 4
    return ModelEntry(
        id=model_id,
        path=path,
        format="gguf",
        architecture=gguf_file.architecture,
        size_bytes=path.stat().st_size,
        weights_bytes=weights,
        estimate_bytes=weights + _ENCODER_WORK_BYTES,
        operations=(operation,),
        refusal=refusal,
    )


class UnservableArchitecture(ValueError):
    """A model this server has no exact implementation of: listed, refused when asked for."""

    def __init__(self, architecture: str, reason: str) -> None:
        super().__init__(reason)
        self.architecture = architecture


# What makes a model servable, from its header or config alone (a pull asks before it
# downloads, with the header of a range request): the reasons `modelhost ls` gives.


def gguf_model_config(gguf_file: GGUFFile) -> ModelConfig:
    """A GGUF file's config; UnservableArchitecture when no family serves its architecture or
    its hyper-parameters cannot be read."""
    architecture = gguf_file.architecture
    try:
        family_for(architecture)
        return gguf_file.config()
    except ValueError as exc:  # an unknown architecture, or rotary variant
        raise UnservableArchitecture(architecture, str(exc)) from exc
    except (KeyError, TypeError) as exc:
        reason = f"its {architecture} hyper-parameters cannot be read ({exc!r} is missing or bad)"
        raise UnservableArchitecture(architecture, reason) from exc


def hf_model_config(raw: dict[str, Any]) -> tuple[str, ModelConfig]:
    """A generative Hugging Face config.json's architecture and config; UnservableArchitecture
    when no family serves it."""
    architecture = str(raw.get("model_type") or "llama")
    try:
        family_for(architecture)
        return architecture, config_from_hf(raw)
    except ValueError as exc:  # an unknown architecture, or rotary variant
        raise UnservableArchitecture(architecture, str(exc)) from exc


def gguf_refusal(gguf_file: GGUFFile) -> str | None:
    """Why a GGUF file cannot be served (None: it can)."""
    try:
        gguf_model_config(gguf_file)
    except UnservableArchitecture as exc:
        return str(exc)
    return unsupported_tensor((t["name"], t["type"], len(t["shape"])) for t in gguf_file.tensors)


def hf_refusal(raw: dict[str, Any], tensors: Sequence[TensorEntry]) -> str | None:
    """Why a Hugging Face folder of this config.json and these tensors cannot be served."""
    if raw.get("model_type") in _ENCODER_TYPES:
        return cross_encoder_refusal(raw) if is_cross_encoder(raw) else None
    try:
        hf_model_config(raw)
    except UnservableArchitecture as exc:
        return str(exc)
    return unsupported_tensor((name, kind, len(dims)) for name, kind, dims in tensors)


def _retrieving(entry: ModelEntry, config: ModelConfig, retrieval: Retrieval) -> ModelEntry:
    """A decoder that embeds or reranks (models/retrieval/retrieval_files.py): it holds its
    weights and one forward's working memory, and keeps no KV cache between requests."""
    work = forward_work_bytes(
        hidden=config.hidden_size,
        intermediate=config.intermediate_size,
        heads=config.num_heads,
        kv_dim=config.num_kv_heads * config.head_dim,
        vocab=config.vocab_size,
    )
    return replace(
        entry,
        operations=(retrieval.operation,),
        refusal=retrieval.refusal or entry.refusal,
        estimate_bytes=entry.weights_bytes + work,
        work_bytes=0,
        kv_row_bytes=0,
        kv_pool_bytes=0,
        store_queue_bytes=0,
    )


def _refused(
    model_id: str, path: Path, fmt: str, refusal: UnservableArchitecture, size: int
) -> ModelEntry:
    return ModelEntry(
        id=model_id,
        path=path,
        format=fmt,
        architecture=refusal.architecture,
        size_bytes=size,
        weights_bytes=size,
        estimate_bytes=size,
        refusal=str(refusal),
    )


def _embedded_transcribers() -> dict[str, Callable[[], Path]]:
    """Whisper base, joined from its two packages (the transcription module knows how)."""
    try:
        from modelhost.audio.whisper_files import WHISPER_BASE, whisper_base_dir
    except ImportError:  # faster-whisper's side of the install is absent
        return {}
    return {WHISPER_BASE: whisper_base_dir}


def _is_whisper_dir(path: Path) -> bool:
    try:
        from modelhost.audio.whisper_files import is_whisper_dir
    except ImportError:
        return False
    return is_whisper_dir(path)


@dataclass(frozen=True, slots=True)
class ServingBytes:
    """A generative model's bytes when served (module docstring): `estimate` held idle, the
    rest claimed while requests run."""

    estimate: int
    work: int = 0
    kv_row: int = 0
    kv_pool: int = 0
    store_queue: int = 0


def serving_context(config: ModelConfig, shape: ServingShape, weights: int) -> int:
    """The window a model is served at: the largest the model budget holds up to its trained
    length (inference/admission.py's `budget_window`), or --context-length when smaller."""
    return budget_window(
        config,
        weights_bytes=weights,
        dtype_bytes=shape.dtype_bytes,
        kv_token_bytes=shape.kv_token_bytes(config),
        budget_bytes=None if shape.cuda else shape.model_budget_bytes,
        context_length=shape.context_length,
        chunk_tokens=shape.chunk_tokens,
        rows=shape.batch,
    )


def serving_bytes(config: ModelConfig, weights: int, shape: ServingShape) -> ServingBytes:
    """What a model holds idle and what its requests may claim, at the serving context."""
    context = serving_context(config, shape, weights)
    token_bytes = shape.kv_token_bytes(config)
    one_row = (context + BLOCK_TOKENS) * token_bytes
    if shape.memory_budget_bytes is not None:  # the KV pool takes what the weights leave
        left = max(0, shape.memory_budget_bytes - weights)
        queue = store_queue_bytes(left) if shape.kv_store else 0
        if shape.cuda:
            return ServingBytes(max(shape.memory_budget_bytes, weights) + queue)
        kept = weights + min(IDLE_KV_BYTES, left)
        return ServingBytes(kept, kv_row=left, kv_pool=left, store_queue=queue)
    budgeted = shape.model_budget_bytes is not None and not shape.cuda
    kv = default_kv_bytes(token_bytes, context, BLOCK_TOKENS, shape.batch, budgeted=budgeted)
    work = working_bytes(
        config, shape.dtype_bytes, context, chunk_tokens=shape.chunk_tokens, rows=shape.batch
    )
    queue = store_queue_bytes(kv) if shape.kv_store else 0
    if shape.cuda:  # a preallocated pool (engine/kv/kv_memory.py): held from the load on
        return ServingBytes(weights + kv + work + queue)
    kept = min(IDLE_KV_BYTES, kv)
    return ServingBytes(
        weights + kept, work=work, kv_row=min(one_row, kv), kv_pool=kv, store_queue=queue
    )


_GGUF_META_VERSION = 3  # the cached config's layout
# A tensor as the registry sees it: name, GGUF type, shape in PyTorch's order.
TensorEntry = tuple[str, int, tuple[int, ...]]


def _read_gguf(path: Path) -> tuple[ModelConfig, str, list[TensorEntry], int, int | None]:
    """What the registry needs of a GGUF file, kept in MODELHOST_HOME/cache keyed by the file's
    path, size and modification time (a scan reads each file's header once): its config,
    architecture, tensors, size and `<arch>.pooling_type` (None where it has none)."""
    size = path.stat().st_size
    cached = modelhost_home() / "cache" / "gguf-meta" / f"{file_cache_key(path)}.json"
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        meta = json.loads(cached.read_text())
        if meta.get("version") == _GGUF_META_VERSION:
            tensors = [(name, kind, tuple(dims)) for name, kind, dims in meta["tensors"]]
            config = ModelConfig.from_json(meta["config"])
            return config, meta["architecture"], tensors, size, meta["pooling"]

    gguf_file = GGUFFile(path)
    architecture = gguf_file.architecture
    config = gguf_model_config(gguf_file)
    tensors = [(t["name"], t["type"], tuple(reversed(t["shape"]))) for t in gguf_file.tensors]
    pooling = gguf_file.arch_field("pooling_type")
    meta = {
        "version": _GGUF_META_VERSION,
        "config": asdict(config),
        "architecture": architecture,
        "tensors": tensors,
        "pooling": int(pooling) if pooling is not None else None,
    }
    with contextlib.suppress(OSError):  # a read-only home only costs the next scan its time
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_suffix(f".{os.getpid()}.partial")
        partial.write_text(json.dumps(meta))
        partial.replace(cached)
    return config, architecture, tensors, size, meta["pooling"]


def _safetensors_tensors(path: Path) -> list[TensorEntry]:
    """One safetensors file's tensors, from its JSON header alone."""
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return safetensors_header_tensors(header)


def safetensors_header_tensors(header: dict[str, Any]) -> list[TensorEntry]:
    """The tensors a safetensors file's JSON header lists."""
    return [
        (name, footprint.safetensors_type(t["dtype"]), tuple(t["shape"]))
        for name, t in header.items()
        if name != "__metadata__"
    ]


def _snapshot(repo: Path) -> Path | None:
    ref = repo / "refs" / "main"
    if ref.is_file():
        snapshot = repo / "snapshots" / ref.read_text().strip()
        if snapshot.is_dir():
            return snapshot
    snapshots = [s for s in (repo / "snapshots").glob("*") if s.is_dir()]
    return max(snapshots, key=lambda s: s.stat().st_mtime) if snapshots else None


def _mtime_ns(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


def _inside(path: Path, root: Path) -> bool:
    return path.resolve().is_relative_to(root.resolve())


def _with(entry: ModelEntry, **changes: object) -> ModelEntry:
    return replace(entry, **changes)  # type: ignore[arg-type]
