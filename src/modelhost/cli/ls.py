"""`modelhost ls`: the local models, what they will hold against the budget, and which are
resident.

VISION says whether a model reads images: a folder with a vision tower, or a GGUF with a vision
projector we compute beside it (an `mmproj*.gguf`, models/vision/pairing.py).

WEIGHTS is what the loader keeps of the file (in `--quantize`'s mode), ESTIMATE that plus the
KV pool and one step's working memory. PACKED is the disk its packed weights copy takes,
KV-STORE its blocks in the prefix KV store (residency/disk_caches.py; `modelhost cache` clears
them). A model that cannot be served (an architecture or rotary variant not implemented, a
tensor type the kernels lack) is SUPPORTED "no" and says why under the table. Residency is
asked of a running server (`--url`); with none listening, the column says `-`. A cluster's
front (`serve --cluster`) also says on which nodes each model is resident, and lists the models
resident on other machines' disks too.
"""

from __future__ import annotations

import argparse
from typing import Any

from modelhost.cli.cache import gigabytes
from modelhost.models.modes import HELP as QUANTIZE_HELP
from modelhost.models.modes import MODES

DEFAULT_URL = "http://127.0.0.1:8080"


def add_ls_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("ls", help="list local models")
    parser.add_argument("paths", nargs="*", metavar="PATH", help="more places to look")
    parser.add_argument("--model-budget", type=float, default=None, metavar="GB")
    parser.add_argument("--quantize", choices=MODES, default=None, help=QUANTIZE_HELP)
    parser.add_argument(
        "--kv-cache", choices=("f16", "q8"), default="f16",
        help="the KV format the estimates and windows assume (as `serve --kv-cache`)",
    )  # fmt: skip
    parser.add_argument(
        "--url", default=DEFAULT_URL, help="a running server to ask what is resident"
    )
    return parser


def run_ls(args: argparse.Namespace) -> int:
    from modelhost.cli.cache import totals_line
    from modelhost.inference.admission import BYTES_PER_GB
    from modelhost.residency.disk_caches import model_caches
    from modelhost.residency.model_facts import model_facts
    from modelhost.residency.registry import ModelRegistry, ServingShape
    from modelhost.residency.unit import claim_bytes
    from modelhost.serve_config import cuda_available, default_budget_bytes, quantize_mode

    budget = int(args.model_budget * BYTES_PER_GB) if args.model_budget else default_budget_bytes()
    shape = ServingShape(
        dtype_bytes=2 if cuda_available() else 4,
        quantize=quantize_mode(args),
        model_budget_bytes=budget,  # the window each model gets: the largest this budget holds
        kv_cache=args.kv_cache,
    )
    entries = ModelRegistry(args.paths, shape=shape).entries()
    caches = {row.id: row for row in model_caches(entries)}
    served = _served_rows(args.url)
    resident = None if served is None else {row["id"]: row for row in served}
    rows = [
        ("ID", "FORMAT", "ARCH", "SUPPORTED", "VISION", "SIZE", "WEIGHTS", "ESTIMATE")
        + ("PACKED", "KV-STORE", "WINDOW")
        + ("FITS",)
        + ("RESIDENT",)
    ]
    for entry in entries:
        # Fits: held idle, and one request's claim on a pool that grows (residency/unit.py).
        fits = "yes" if entry.estimate_bytes + claim_bytes(entry, 1) <= budget else "alone"
        rows.append(
            (
                entry.id,
                entry.format,
                entry.architecture or "?",
                "no" if entry.refusal is not None else "yes",
                "yes" if model_facts(entry).vision else "no",
                gigabytes(entry.size_bytes),
                gigabytes(entry.weights_bytes),
                gigabytes(entry.estimate_bytes),
                _cached(caches[entry.id].packed_bytes),
                _cached(caches[entry.id].kv_bytes),
                str(entry.context_length or "-"),
                "refused" if entry.refusal is not None else fits,
                "-" if resident is None else _resident_cell(resident.get(entry.id)),
            )
        )
    local = {entry.id for entry in entries}
    for remote in served or []:  # resident on a cluster node only
        if remote["id"] not in local and remote.get("nodes"):
            rows.append(
                (
                    remote["id"],
                    str(remote.get("format", "?")),
                    str(remote.get("architecture") or "?"),
                    "no" if remote.get("refusal") else "yes",
                    "?",
                    gigabytes(int(remote.get("size_bytes", 0))),
                    "?",
                    gigabytes(int(remote.get("estimate_bytes", 0))),
                    "?",
                    "?",
                    str(remote.get("context_length") or "?"),
                    "?",
                    _resident_cell(remote),
                )
            )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        )
    for entry in entries:
        if entry.refusal is not None:
            print(f"\n{entry.id} cannot be served: {entry.refusal}", end="")
    print(f"\nmodel budget {gigabytes(budget)}; {totals_line()}", end="")
    print("" if resident is not None else f"; no server answered at {args.url}")
    return 0


def _cached(num_bytes: int) -> str:
    return gigabytes(num_bytes) if num_bytes else "-"


def _served_rows(url: str) -> list[dict[str, Any]] | None:
    """The resident rows of the server at `url` (None: no server answered)."""
    import httpx

    try:
        response = httpx.get(f"{url.rstrip('/')}/v1/models", timeout=1.0)
        rows = response.json()["data"]
        return [row for row in rows if isinstance(row, dict) and row.get("resident", True)]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


def _resident_cell(row: dict[str, Any] | None) -> str:
    """`no`, `yes`, or on a cluster `yes: NODE, NODE`."""
    if row is None:
        return "no"
    nodes = row.get("nodes")
    return f"yes: {', '.join(nodes)}" if nodes else "yes"
