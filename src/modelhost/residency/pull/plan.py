"""Which files of a hub repo a pull fetches, from the repo's file list (`model_info` with
files metadata): a GGUF repo's one file of the asked quantization, or a safetensors repo's
weights, index, tokenizer and config files. The order is the download order: weights first and
config.json last, so that a pull cut short never leaves a folder that lists as a model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from modelhost.residency.pull.reference import DEFAULT_QUANT, HubReference, PullError

_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
_QUANT_TOKEN = re.compile(r"^(i?q\d\w*|[bf]f?16|f32|tq\d_\d|mxfp4)$", re.IGNORECASE)
# Beside the weights, what loading a Hugging Face folder reads (tokenizer, chat template, the
# sampling defaults); config.json comes last of all.
HF_SIDE_FILES = (
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


@dataclass(frozen=True, slots=True)
class HubFile:
    name: str  # the path in the repo
    size: int
    sha256: str | None  # an LFS file's (the hub's checksum of its content)
    blob_id: str | None  # a git blob's id (a small file's checksum: git's sha1)

    @property
    def digest(self) -> str:
        """How Ollama's progress names it: `sha256:<hex>` (a git blob id for a small file)."""
        return f"sha256:{self.sha256}" if self.sha256 else f"sha1:{self.blob_id or ''}"


@dataclass(frozen=True, slots=True)
class PullPlan:
    reference: HubReference
    commit: str  # the revision's commit, as the hub named it
    kind: Literal["gguf", "safetensors"]
    files: tuple[HubFile, ...]  # in download order

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def model_id(self) -> str:
        """The id the registry lists the pulled model under."""
        if self.kind == "gguf":
            return self.files[0].name.rsplit("/", 1)[-1].removesuffix(".gguf")
        return self.reference.repo_id


def hub_files(siblings: Any) -> list[HubFile]:
    files = []
    for sibling in siblings or ():
        lfs = getattr(sibling, "lfs", None)
        sha256 = lfs.sha256 if lfs is not None else None
        size = lfs.size if lfs is not None else sibling.size
        files.append(HubFile(sibling.rfilename, int(size or 0), sha256, sibling.blob_id))
    return files


def plan_files(reference: HubReference, commit: str, files: list[HubFile]) -> PullPlan:
    ggufs = [f for f in files if f.name.lower().endswith(".gguf") and not _is_projector(f.name)]
    if ggufs:
        return PullPlan(reference, commit, "gguf", (_gguf_choice(reference, ggufs),))
    if reference.quant:
        raise PullError(
            404,
            f"repo '{reference.repo_id}' has no GGUF files: a quantization "
            f"(':{reference.quant}') picks a GGUF repo's file; pull '{reference.repo_id}' "
            "for its safetensors weights",
        )
    names = {f.name: f for f in files}
    weights = sorted(
        (f for f in files if "/" not in f.name and f.name.endswith(".safetensors")),
        key=lambda f: f.name,
    )
    if "config.json" not in names or not weights:
        raise PullError(
            400,
            f"repo '{reference.repo_id}' holds neither GGUF files nor a safetensors model "
            "(config.json and *.safetensors): nothing modelhost can serve",
        )
    side = [names[name] for name in HF_SIDE_FILES if name in names]
    return PullPlan(reference, commit, "safetensors", (*weights, *side, names["config.json"]))


def _is_projector(name: str) -> bool:
    return "mmproj" in name.rsplit("/", 1)[-1].lower()


def _tokens(name: str) -> list[str]:
    return [t for t in re.split(r"[-./]", _SPLIT.sub(".gguf", name).lower()) if t]


def quant_files(names: list[str], quant: str | None) -> list[str]:
    """The GGUF file names (no vision projector) a quantization picks, best first: those whose
    name holds it as a whole token, in any case; with none named, Q4_K_M's, or the only one."""
    ggufs = [n for n in names if n.lower().endswith(".gguf") and not _is_projector(n)]
    wanted = (quant or DEFAULT_QUANT).lower()
    matches = sorted(n for n in ggufs if wanted in _tokens(n))
    if not matches and quant is None and len(ggufs) == 1:
        return ggufs  # a repo of one GGUF: that one, whatever its quantization
    return matches


def _gguf_choice(reference: HubReference, ggufs: list[HubFile]) -> HubFile:
    wanted = (reference.quant or DEFAULT_QUANT).lower()
    by_name = {f.name: f for f in ggufs}
    matches = [by_name[n] for n in quant_files(list(by_name), reference.quant)]
    if not matches:
        offered = sorted(
            {t.upper() for f in ggufs for t in _tokens(f.name) if _QUANT_TOKEN.match(t)}
        )
        raise PullError(
            404,
            f"repo '{reference.repo_id}' has no {wanted.upper()} GGUF file; it offers "
            + (", ".join(offered) or ", ".join(sorted(f.name for f in ggufs)))
            + f" (pull {reference.repo_id}:QUANT)",
        )
    first = matches[0]
    split = _SPLIT.search(first.name)
    if split is not None:
        raise PullError(
            400,
            f"{reference.repo_id}'s {wanted.upper()} file is split into {int(split.group(2))} "
            "parts: modelhost serves single-file GGUF models (merge them with llama.cpp's "
            "gguf-split --merge, or pick another quantization)",
        )
    return first
