"""What a decoder's files say it does besides generating, read without PyTorch (the registry
lists embedders and rerankers from them):

- a **decoder embedder** (Qwen3-Embedding): a sentence-transformers folder (`modules.json`
  naming a Transformer, a Pooling whose `1_Pooling/config.json` sets `pooling_mode_lasttoken`,
  and optionally a Normalize), or a GGUF whose `<arch>.pooling_type` is LAST (3), as
  llama.cpp's converter writes it from those files;
- a **decoder reranker** (Qwen3-Reranker): a Qwen3 causal LM folder that the model's name
  calls one (its folder, id or config's `_name_or_path` contains "reranker": the weights are a
  plain Qwen3ForCausalLM, so nothing else in its files tells it from a chat model; llama.cpp's
  converter decides the same way); or a Qwen3 GGUF as that converter writes one: rank
  pooling (4) and a `cls.output` head. It is scored from the next-token odds of "yes" against
  "no".

A file that says it embeds or reranks in a way not served here is listed with its refusal,
never served as something else.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modelhost.models.families import family_for
from modelhost.models.loading.gguf_header import GGUFFile
from modelhost.models.loading.hf_config import read_json

# llama.cpp's `<arch>.pooling_type` (enum llama_pooling_type).
POOLING_NONE, POOLING_MEAN, POOLING_CLS, POOLING_LAST, POOLING_RANK = 0, 1, 2, 3, 4
_POOLING_NAMES = {POOLING_MEAN: "mean", POOLING_CLS: "cls", POOLING_RANK: "rank"}
RANK_HEAD = "cls.output.weight"  # a reranker GGUF's head: the LM head's rows of yes and no
RERANKER_FAMILY = "qwen3"  # the decoder rerankers served: Qwen3-Reranker's prompt and head
_SERVED_MODULES = ("Transformer", "Pooling", "Normalize")  # sentence_transformers.models.*

# One forward's bounds (models/retrieval/whole_prompts.py): padded tokens, rows, and attention
# elements per head (rows x longest^2: the mask, and SDPA's scores where it builds them); the
# registry's estimate reads them.
BATCH_TOKENS = 16384  # as many as a cross-encoder forward takes (models/networks/cross_encoder.py)
BATCH_ROWS = 128
BATCH_SCORES = 4 << 20


@dataclass(frozen=True, slots=True)
class SentenceFiles:
    """What a sentence-transformers folder's own files say about its embedding."""

    pooling: str  # "lasttoken", "mean", "cls", ... (1_Pooling/config.json)
    normalize: bool  # a Normalize module follows the pooling
    modules: tuple[str, ...]  # the modules' class names, in order
    prompts: dict[str, str] = field(default_factory=dict)  # config_sentence_transformers.json
    default_prompt_name: str | None = None
    max_seq_length: int | None = None  # where texts are cut (the model's window bounds it)


def sentence_files(path: Path) -> SentenceFiles | None:
    """The folder's sentence-transformers description; None when it has no modules.json."""
    listed = read_json(path / "modules.json") if (path / "modules.json").is_file() else None
    if not isinstance(listed, list):
        return None
    modules, pooling_dir = [], None
    for module in listed:
        kind = str(module.get("type", "")).rpartition(".")[2]
        modules.append(kind)
        if kind == "Pooling":
            pooling_dir = path / str(module.get("path", ""))
    pooling = _pooling_mode(read_json(pooling_dir / "config.json")) if pooling_dir else "none"
    settings = read_json(path / "config_sentence_transformers.json")
    prompts = settings.get("prompts")
    # sentence-transformers before v6 wrote max_seq_length here; v6 writes it as the
    # tokenizer's model_max_length.
    max_seq = read_json(path / "sentence_bert_config.json").get("max_seq_length")
    if max_seq is None:
        max_seq = read_json(path / "tokenizer_config.json").get("model_max_length")
    default = settings.get("default_prompt_name")
    return SentenceFiles(
        pooling=pooling,
        normalize="Normalize" in modules,
        modules=tuple(modules),
        prompts={str(k): str(v) for k, v in prompts.items()} if isinstance(prompts, dict) else {},
        default_prompt_name=default if isinstance(default, str) else None,
        max_seq_length=max_seq if isinstance(max_seq, int) and max_seq > 0 else None,
    )


def _pooling_mode(config: dict[str, Any]) -> str:
    for mode in ("lasttoken", "mean_tokens", "cls_token", "max_tokens", "weightedmean_tokens"):
        if config.get(f"pooling_mode_{mode}"):
            return mode.removesuffix("_tokens").removesuffix("_token")
    return str(config.get("pooling_mode") or "none")


@dataclass(frozen=True, slots=True)
class Retrieval:
    """A decoder that embeds or reranks, and why it cannot be served (None: it can)."""

    operation: str  # "embed" or "rerank"
    refusal: str | None = None


def folder_retrieval(path: Path, names: tuple[str, ...], raw: dict[str, Any]) -> Retrieval | None:
    """What a decoder folder (config.json `raw`) does besides generating; None: it generates.
    `names`: what the registry calls it (its id; the folder's own name is added)."""
    described = sentence_files(path)
    if described is not None:
        return Retrieval("embed", _embedder_refusal(described))
    hints = (*names, path.name, str(raw.get("_name_or_path") or ""))
    if any("reranker" in hint.lower() for hint in hints):
        return Retrieval("rerank", reranker_refusal(str(raw.get("model_type") or "")))
    if any(str(a).endswith("ForSequenceClassification") for a in raw.get("architectures") or ()):
        # Qwen3-Reranker converted to a classifier (a `score` head, no LM head)
        reason = "a decoder sequence classifier is not served; serve the causal LM it came from"
        return Retrieval("rerank", reason)
    return None


def _embedder_refusal(described: SentenceFiles) -> str | None:
    extra = [m for m in described.modules if m not in _SERVED_MODULES]
    if extra:
        return f"its sentence-transformers modules {', '.join(extra)} are not served"
    if described.pooling != "lasttoken":
        return (
            f"decoder embedders are served with last-token pooling; this one pools by "
            f"{described.pooling}"
        )
    return None


def reranker_refusal(architecture: str) -> str | None:
    if architecture != RERANKER_FAMILY:
        return (
            f"decoder rerankers are served in Qwen3-Reranker's format (a qwen3 causal LM "
            f"answering yes or no); this one is {architecture or 'unknown'}"
        )
    return None


def gguf_retrieval(
    pooling_type: int | None, architecture: str, tensor_names: Collection[str]
) -> Retrieval | None:
    """What a decoder GGUF whose header's `<arch>.pooling_type` is `pooling_type` does
    besides generating; None: it generates. Rank pooling with a `cls.output` head of two rows
    is llama.cpp's Qwen3-Reranker (its converter keeps the yes and no rows of the LM head)."""
    if pooling_type is None or pooling_type == POOLING_NONE:
        return None
    if pooling_type == POOLING_LAST:
        return Retrieval("embed")
    if pooling_type == POOLING_RANK:
        if RANK_HEAD not in tensor_names:
            return Retrieval("rerank", f"its rank pooling has no {RANK_HEAD} head")
        return Retrieval("rerank", reranker_refusal(architecture))
    name = _POOLING_NAMES.get(pooling_type, str(pooling_type))
    return Retrieval("embed", f"decoder embedders are served with last-token pooling, not {name}")


def is_decoder(path: Path) -> bool:
    """Whether the model at `path` is a decoder some family record serves: an embedder or a
    reranker of that kind loads through the decoder's own loader."""
    if path.suffix == ".gguf":
        architecture = GGUFFile(path).architecture
    else:
        architecture = str(read_json(path / "config.json").get("model_type") or "")
    try:
        family_for(architecture)
    except ValueError:
        return False
    return True


def forward_work_bytes(
    *, hidden: int, intermediate: int, heads: int, kv_dim: int, vocab: int
) -> int:
    """The most one retrieval forward holds beside the weights (fp32): activations of
    BATCH_TOKENS tokens, one layer's keys and values (every layer shares one pool), attention
    scores where SDPA builds them, and logits for BATCH_ROWS rows (a reranker's)."""
    activations = BATCH_TOKENS * (4 * hidden + 3 * intermediate) * 4
    keys_values = BATCH_TOKENS * 2 * kv_dim * 4
    return activations + keys_values + heads * BATCH_SCORES * 4 + BATCH_ROWS * vocab * 4
