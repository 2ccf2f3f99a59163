"""`modelhost cache ls|clear`: the disk the caches take, by model (the packed copies of GGUF
weights under MODELHOST_HOME/cache/gguf, the prefix KV store under MODELHOST_HOME/kv), and
removing them. Works on the files directly, with or without a server running
(residency/disk_caches.py says what a running server keeps)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from modelhost.paths import gguf_cache_root

if TYPE_CHECKING:
    from modelhost.residency.disk_caches import ModelCaches

# The caches' modules are imported where they are used: `modelhost serve` parses its
# arguments with this parser beside the others, and starts its fork server only after.


def add_cache_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "cache", help="the caches on disk (packed weights, prefix KV store): list or clear them"
    )
    actions = parser.add_subparsers(dest="cache_command", required=True)
    listing = actions.add_parser("ls", help="what each model's caches take on disk")
    listing.add_argument("paths", nargs="*", metavar="PATH", help="more places to look")
    clear = actions.add_parser("clear", help="remove every model's caches, or one's")
    clear.add_argument(
        "model", nargs="?", default=None, metavar="MODEL",
        help="a local model id or a model's file (default: every model's)",
    )  # fmt: skip
    only = clear.add_mutually_exclusive_group()
    only.add_argument("--packed", action="store_true", help="only the packed weights")
    only.add_argument("--kv", action="store_true", help="only the prefix KV store's blocks")
    return parser


def run_cache(args: argparse.Namespace) -> int:
    if args.cache_command == "clear":
        return _clear(args.model, packed=not args.kv, kv=not args.packed)
    rows = [row for row in _rows(args.paths) if row.packed_bytes or row.kv_bytes]
    table = [("MODEL", "PACKED", "KV-STORE")]
    for row in rows:
        name = row.id if row.listed else f"{row.id} (no listed model's file)"
        kv = f"{gigabytes(row.kv_bytes)} ({row.kv_blocks} blocks)" if row.kv_blocks else "-"
        table.append((name, gigabytes(row.packed_bytes) if row.packed_bytes else "-", kv))
    widths = [max(len(line[i]) for line in table) for i in range(3)]
    for line in table:
        cells = (cell.ljust(width) for cell, width in zip(line, widths, strict=True))
        print("  ".join(cells).rstrip())
    print(f"\n{totals_line()}")
    return 0


def totals_line() -> str:
    """For `modelhost ls` and `cache ls`: what the two caches hold, and where."""
    from modelhost.residency.disk_caches import packed_files
    from modelhost.residency.kv.kv_store import KVDiskStore

    packed = sum(file.bytes for file in packed_files())
    kv = KVDiskStore().usage()
    return (
        f"packed weights {gigabytes(packed)} in {gguf_cache_root()}; "
        f"KV store {gigabytes(kv.bytes)} ({kv.files} blocks) in {kv.path}"
    )


def _rows(paths: list[str], model_id: str | None = None) -> list[ModelCaches]:
    from modelhost.residency.disk_caches import model_caches
    from modelhost.residency.registry import ModelRegistry

    registry = ModelRegistry(paths)
    if model_id is None:
        entries = registry.entries()
    else:
        entry = registry.resolve_argument(model_id)
        entries = [entry] if entry is not None else []
    return model_caches(entries)


def _clear(model_id: str | None, *, packed: bool, kv: bool) -> int:
    from modelhost.residency.disk_caches import clear_packed, packed_files
    from modelhost.residency.kv.kv_store import KVDiskStore, default_budget_bytes

    store = KVDiskStore(budget_bytes=default_budget_bytes())
    files = packed_files()
    kv_id = None
    if model_id is not None:
        rows = _rows([], model_id)
        row = next((r for r in rows if r.id == model_id or r.listed), None)
        if row is None:
            print(f"modelhost: '{model_id}' is not a local model", file=sys.stderr)
            return 2
        files, kv_id = row.packed_files, row.id
    if packed:
        cleared = clear_packed(files)
        print(f"removed {gigabytes(cleared.removed_bytes)} of packed weights")
        for path, pids in cleared.kept.items():
            print(
                f"kept {path}: mapped by process {', '.join(map(str, pids))} (a resident "
                "model's worker); its disk comes back only when that process ends: unload "
                "the model or stop the server, then clear again"
            )
    if kv:
        removed = store.clear(kv_id)
        print(f"removed {gigabytes(removed.bytes)} ({removed.files} blocks) from {removed.path}")
    return 0


def gigabytes(num_bytes: int) -> str:
    """A byte count as `modelhost ls` and `cache ls` print it."""
    from modelhost.inference.admission import BYTES_PER_GB

    return f"{num_bytes / BYTES_PER_GB:.2f} GB"
