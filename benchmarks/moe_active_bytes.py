"""What a decode step of a mixture-of-experts GGUF reads, from its tensor table (issue 28).

    python benchmarks/moe_active_bytes.py FILE.gguf [--streams 1,8] [--results user-sized.json]
                                          [--read-rate 23]

A step of R rows (one token each) reads every non-expert weight once (the token embedding: only
R rows of it) and, in each layer, the experts its rows chose: with k of E experts a row, about
E (1 - (1 - k/E)^R) distinct experts under routing spread evenly over them (what random
weights give; a trained router is lumpier, which reads fewer). Given benchmarks/user_sized.py's
JSON, each server's decode rate at R streams becomes bytes read a second and a share of the
machine's read rate (`--read-rate`, GB/s: benchmarks/README's 4 GB fp32 sum on two threads).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from modelhost.models.loading.gguf_header import read_header

_EXPERT = re.compile(r"blk\.\d+\.ffn_(gate|up|down)_exps\.weight$")


def step_bytes(path: Path, rows: int) -> dict[str, float]:
    """Bytes in the file, and bytes one decode step of `rows` rows reads (expected)."""
    fields, tensors = read_header(path)
    arch = fields["general.architecture"]
    experts = int(fields[f"{arch}.expert_count"])
    used = int(fields[f"{arch}.expert_used_count"])
    distinct = experts * (1 - (1 - used / experts) ** rows)
    total = sum(t["nbytes"] for t in tensors)
    read = 0.0
    for tensor in tensors:
        if tensor["name"] == "token_embd.weight":
            read += rows * tensor["nbytes"] / tensor["shape"][-1]
        elif _EXPERT.match(tensor["name"]):
            read += distinct * tensor["nbytes"] / experts
        else:
            read += tensor["nbytes"]
    return {"file_bytes": total, "step_bytes": read, "distinct_experts": distinct}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("--streams", default="1,8")
    parser.add_argument("--results", type=Path, default=None, help="user_sized.py's JSON")
    parser.add_argument("--read-rate", type=float, default=23.0, help="GB/s the machine reads")
    args = parser.parse_args(argv)
    results = json.loads(args.results.read_text()) if args.results else None
    for rows in (int(s) for s in args.streams.split(",")):
        figures = step_bytes(args.file, rows)
        line = (
            f"{rows} stream(s): a step reads {figures['step_bytes'] / 1e9:.3f} GB of "
            f"{figures['file_bytes'] / 1e9:.3f} GB ({figures['distinct_experts']:.1f} experts a "
            f"layer)"
        )
        print(line)
        for server, rate in _decode_rates(results, args.file, rows):
            steps = rate / rows
            gbs = steps * figures["step_bytes"] / 1e9
            print(
                f"  {server}: {rate:.2f} tok/s -> {gbs:.1f} GB/s read, "
                f"{gbs / args.read_rate:.0%} of {args.read_rate:g} GB/s"
            )


def _decode_rates(results: object, file: Path, rows: int) -> list[tuple[str, float]]:
    """(server, aggregate decode tok/s at `rows` streams) from user_sized.py's JSON."""
    found: list[tuple[str, float]] = []
    if not isinstance(results, dict):
        return found
    for entry in results.get("files", []):
        if Path(entry.get("path", "")).name != file.name:
            continue
        for server, run in entry.get("servers", {}).items():
            level = (run.get("streams") or {}).get(str(rows)) or {}
            if level.get("aggregate_tps"):
                found.append((server, float(level["aggregate_tps"])))
    return found


if __name__ == "__main__":
    main()
