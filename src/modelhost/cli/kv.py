"""`modelhost kv ls|clear`: what the prefix KV store on disk (MODELHOST_HOME/kv) holds, and
emptying it. Works on the files directly, with or without a server running."""

from __future__ import annotations

import argparse

from modelhost.residency.kv.kv_store import KVDiskStore, default_budget_bytes
from modelhost.residency.kv.kv_usage import StoreUsage


def add_kv_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("kv", help="the prefix KV store on disk: list or clear it")
    actions = parser.add_subparsers(dest="kv_command", required=True)
    actions.add_parser("ls", help="its size, by model")
    clear = actions.add_parser("clear", help="remove its blocks (every model's, or one's)")
    clear.add_argument("--model", default=None, metavar="ID", help="only this model's blocks")
    return parser


def run_kv(args: argparse.Namespace) -> int:
    store = KVDiskStore(budget_bytes=default_budget_bytes())
    if args.kv_command == "clear":
        removed = store.clear(args.model)
        print(f"removed {_size(removed)} from {removed.path}")
        return 0
    usage = store.usage()
    for model in usage.models:
        print(f"{model.id}  {model.bytes / 1e9:.2f} GB  {model.files} blocks")
    print(f"{usage.path}: {_size(usage)}")
    return 0


def store_line() -> str:
    """For `modelhost ls`: what the store holds, and where."""
    usage = KVDiskStore().usage()
    return f"KV store {_size(usage)} in {usage.path}"


def _size(usage: StoreUsage) -> str:
    return f"{usage.bytes / 1e9:.2f} GB ({usage.files} blocks)"
