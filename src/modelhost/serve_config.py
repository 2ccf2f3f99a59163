"""Serve settings, read once: from `modelhost serve`'s arguments, and by a worker process from
the `--config` its parent gives it.

A worker gets its parent's settings less the API key (its socket is its parent's alone, and a
key on its command line would show in `ps` for every user of the machine), the engine's shape
and the parent's `--threads`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from modelhost.engine.kv.kv_format import parse_kv_format
from modelhost.engine.prompt_activations import parse_prompt_activations
from modelhost.inference.admission import BYTES_PER_GB
from modelhost.models.modes import default_mode
from modelhost.residency.kv.kv_store import default_budget_bytes as default_kv_disk_bytes
from modelhost.residency.registry import ServingShape
from modelhost.residency.workers import WORKER_MODULE
from modelhost.residency.workers.supervisor import proc_bytes
from modelhost.server.edge.limits import DEFAULT_MAX_BODY_BYTES, MiB
from modelhost.server.settings import ServeSettings

SETTING_FIELDS = frozenset(ServeSettings.__dataclass_fields__)
# A worker process's entry, and the file beside its socket where `--listen` writes its TCP port:
# the same on this machine (assembly.worker_loader) and on a cluster's node (cluster/actors.py).
WORKER_COMMAND = (sys.executable, "-m", WORKER_MODULE)
TCP_PORT_FILE = "tcp-port"


def settings_from_args(args: argparse.Namespace) -> ServeSettings:
    return ServeSettings(
        heartbeat_s=args.heartbeat,
        memory_budget_gb=args.memory_budget,
        model_budget_bytes=model_budget_bytes(args),
        kv_cache=parse_kv_format(getattr(args, "kv_cache", "f16")),
        context_length=args.context_length,
        context_overflow=getattr(args, "context_overflow", "error"),
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        host=args.host,
        api_key=api_key_from(args),
        cors_origins=tuple(args.cors_origin),
        max_body_bytes=(
            DEFAULT_MAX_BODY_BYTES if args.max_body_mb is None else int(args.max_body_mb * MiB)
        ),
        log_format=args.log_format,
        prompt_threads=args.prompt_threads,
        prompt_activations=parse_prompt_activations(getattr(args, "prompt_activations", "auto")),
        kv_disk_bytes=kv_disk_bytes(args),
        kv_hold_s=max(0.0, getattr(args, "hold", 0.0), getattr(args, "kv_hold", 0.0)),
        speculate=getattr(args, "speculate", "auto"),
        console=not getattr(args, "no_console", False),
        image_urls=bool(getattr(args, "image_urls", False)),
    )


def model_budget_bytes(args: argparse.Namespace) -> int:
    """--model-budget in bytes; without it, the default (70% of memory)."""
    gb = getattr(args, "model_budget", None)
    return int(gb * BYTES_PER_GB) if gb else default_budget_bytes()


def kv_disk_bytes(args: argparse.Namespace) -> int:
    """--kv-disk in bytes; without it, the store's default budget."""
    gb = getattr(args, "kv_disk", None)
    if gb is None:
        return default_kv_disk_bytes()
    return max(0, int(gb * BYTES_PER_GB))


def api_key_from(args: argparse.Namespace) -> str | None:
    """--api-key, else the first line of --api-key-file, else $MODELHOST_API_KEY, else None."""
    if args.api_key:
        return str(args.api_key)
    if args.api_key_file:
        try:
            key = Path(args.api_key_file).read_text().strip()
        except OSError as exc:
            raise SystemExit(f"modelhost serve: cannot read --api-key-file: {exc}") from None
        if not key:
            raise SystemExit(f"modelhost serve: --api-key-file {args.api_key_file} is empty")
        return key
    return os.environ.get("MODELHOST_API_KEY") or None


def cuda_available() -> bool:
    """Whether models run on CUDA here. PyTorch is asked only where an NVIDIA driver is
    present: importing it costs ~200 MB of resident memory, which the front process of a
    worker-mode server otherwise never pays."""
    nvidia = ("/dev/nvidiactl", "/proc/driver/nvidia/version")
    if sys.platform == "linux" and not any(os.path.exists(path) for path in nvidia):
        return False
    import torch

    return bool(torch.cuda.is_available())


def default_budget_bytes() -> int:
    """70% of GPU memory on CUDA, else of physical RAM."""
    if cuda_available():
        import torch

        total = torch.cuda.get_device_properties(0).total_memory
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(total * 0.7)


def available_memory_bytes() -> int | None:
    """What this machine can still give a new model: MemAvailable on Linux; None elsewhere, and
    on CUDA, where a model's bytes are the GPU's."""
    if cuda_available():
        return None
    return proc_bytes("/proc/meminfo", "MemAvailable:")


def serving_shape(args: argparse.Namespace, settings: ServeSettings) -> ServingShape:
    budget = settings.memory_budget_gb
    return ServingShape(
        dtype_bytes=2 if cuda_available() else 4,
        batch=args.batch,
        chunk_tokens=settings.chunk_tokens,
        context_length=settings.context_length,
        memory_budget_bytes=int(budget * BYTES_PER_GB) if budget is not None else None,
        quantize=quantize_mode(args),
        kv_store=settings.kv_disk_bytes > 0,
        model_budget_bytes=settings.model_budget_bytes,
        kv_cache=settings.kv_cache,
    )


def parse_replicas(values: list[str]) -> dict[str, int]:
    """`--replicas MODEL=N` (repeatable) as {model: N}."""
    replicas: dict[str, int] = {}
    for value in values:
        model, _, count = value.rpartition("=")
        if not model or not count.isdigit() or int(count) < 1:
            raise SystemExit(f"modelhost serve: --replicas takes MODEL=N (N >= 1), not '{value}'")
        replicas[model] = int(count)
    return replicas


def quantize_mode(args: argparse.Namespace) -> str:
    """`--quantize`, else MODELHOST_QUANTIZE, else the default (loading/quant.py says each)."""
    return getattr(args, "quantize", None) or default_mode()


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """What a worker process is told: the serving settings and the engine's shape."""

    settings: ServeSettings
    batch: int = 8
    max_queue: int = 64
    threads: int | None = None  # the parent's intra-op threads (`--threads`)
    quantize: str | None = None  # `--quantize` (None: MODELHOST_QUANTIZE, else auto)

    def to_json(self) -> str:
        shared = {k: v for k, v in asdict(self.settings).items() if k != "api_key"}
        body = {"settings": shared, "batch": self.batch, "max_queue": self.max_queue}
        return json.dumps({**body, "threads": self.threads, "quantize": self.quantize})

    @classmethod
    def from_json(cls, text: str) -> WorkerConfig:
        config: dict[str, Any] = json.loads(text)
        raw = {k: v for k, v in config.get("settings", {}).items() if k in SETTING_FIELDS}
        raw["adapters"] = tuple(tuple(entry) for entry in raw.get("adapters", ()))
        settings = ServeSettings(**{**raw, "owner": "worker"})
        threads = config.get("threads")
        return cls(
            settings,
            batch=int(config.get("batch", 8)),
            max_queue=int(config.get("max_queue", 64)),
            threads=int(threads) if threads else None,
            quantize=config.get("quantize"),
        )
