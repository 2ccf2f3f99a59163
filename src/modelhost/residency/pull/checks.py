"""What a pull checks before it fetches a weight: that modelhost can serve the model (the
GGUF header, read by range requests; or config.json and each safetensors header), for the
reasons `modelhost ls` gives, and that the disk has room for what is not cached yet."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

from huggingface_hub import try_to_load_from_cache

from modelhost.inference.admission import BYTES_PER_GB
from modelhost.models.loading.gguf_header import GGUFFile, HeaderTruncated
from modelhost.residency.pull.hub_access import read_range
from modelhost.residency.pull.plan import HubFile, PullPlan
from modelhost.residency.pull.reference import PullError
from modelhost.residency.registry import gguf_refusal, hf_refusal, safetensors_header_tensors

FIRST_READ = 1 << 20  # most GGUF headers fit in this; a large vocabulary takes a few more
MAX_HEADER = 256 << 20
# Room kept free beside the files: the hub client's temporary file is the blob's own size.
DISK_MARGIN = 64 << 20


def refusal(plan: PullPlan) -> str | None:
    """Why the planned model cannot be served (None: it can), from headers alone."""
    if plan.kind == "gguf":
        return gguf_header_refusal(plan, plan.files[0])
    return safetensors_refusal(plan)


def gguf_header_refusal(plan: PullPlan, gguf: HubFile) -> str | None:
    prefix = b""
    want = min(FIRST_READ, gguf.size)
    while True:
        if want > len(prefix):
            prefix += read_range(plan.reference, plan.commit, gguf.name, len(prefix), want)
        try:
            header = GGUFFile.from_prefix(gguf.name, prefix, gguf.size)
            return gguf_refusal(header)
        except HeaderTruncated as short:
            if len(prefix) >= min(gguf.size, MAX_HEADER):
                raise PullError(400, f"{gguf.name} is not a readable GGUF file") from short
            want = min(gguf.size, MAX_HEADER, max(2 * len(prefix), short.needed + FIRST_READ))
        except ValueError as bad:  # not GGUF at all
            raise PullError(400, f"{gguf.name}: {bad}") from bad


def safetensors_refusal(plan: PullPlan) -> str | None:
    by_name = {f.name: f for f in plan.files}
    config = by_name["config.json"]
    try:
        raw = json.loads(read_range(plan.reference, plan.commit, "config.json", 0, config.size))
    except ValueError as bad:
        raise PullError(400, f"{plan.reference.repo_id}'s config.json is not JSON") from bad
    if not isinstance(raw, dict):
        raise PullError(400, f"{plan.reference.repo_id}'s config.json is not a JSON object")
    tensors = []
    for weights in plan.files:
        if not weights.name.endswith(".safetensors"):
            continue
        start = read_range(plan.reference, plan.commit, weights.name, 0, 8)
        (length,) = struct.unpack("<Q", start) if len(start) == 8 else (MAX_HEADER + 1,)
        if length > MAX_HEADER:
            raise PullError(400, f"{weights.name} is not a readable safetensors file")
        header = read_range(plan.reference, plan.commit, weights.name, 8, 8 + length)
        try:
            tensors += safetensors_header_tensors(json.loads(header))
        except (ValueError, KeyError, TypeError, AttributeError) as bad:
            raise PullError(400, f"{weights.name} is not a readable safetensors file") from bad
    return hf_refusal(raw, tensors)


def check_disk(plan: PullPlan, cache_dir: Path) -> None:
    """A 507 when the files not yet in the cache do not fit on its disk."""
    missing = [
        f
        for f in plan.files
        if not isinstance(
            try_to_load_from_cache(
                plan.reference.repo_id, f.name, cache_dir=cache_dir, revision=plan.commit
            ),
            str,
        )
    ]
    needed = sum(f.size for f in missing)
    existing = cache_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    if needed + DISK_MARGIN > free:
        raise PullError(
            507,
            f"not enough free disk for {plan.reference}: it needs "
            f"{needed / BYTES_PER_GB:.2f} GB, {free / BYTES_PER_GB:.2f} GB are free in {existing}",
        )
