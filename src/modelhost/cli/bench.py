"""`modelhost bench`: TTFT, inter-token latency and throughput against a running server."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported by the command alone: `serve` parses with this parser too
    from modelhost.bench import BenchReport, LevelResult


def _run_client(work: Coroutine[Any, Any, BenchReport]) -> BenchReport:
    """Runs the clients on uvloop where it is installed: the client shares the machine with
    the server it measures, and uvloop cut its CPU a streamed token from ~320 to ~220 us."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(work)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(work)


def _levels(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError("a comma-separated list of integers") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("concurrency levels must be >= 1")
    return levels


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "bench",
        help="load-test an OpenAI-compatible server (TTFT, ITL, tok/s per concurrency)",
        description="Stream chat completions from concurrent clients and time every token.",
    )
    parser.add_argument("--url", default="http://127.0.0.1:8080", help="server base URL")
    parser.add_argument("--concurrency", type=_levels, default=(1, 4, 8), metavar="1,4,8")
    parser.add_argument("--prompt-tokens", type=int, default=128, metavar="N")
    parser.add_argument("--max-tokens", type=int, default=64, metavar="N")
    parser.add_argument(
        "--requests", type=int, default=None, metavar="N",
        help="requests per level (default and minimum: one per client)",
    )  # fmt: skip
    parser.add_argument(
        "--ignore-eos", action="store_true",
        help="ask the server to generate all --max-tokens (ignore_eos in the request)",
    )  # fmt: skip
    parser.add_argument("--model", default=None, help="the request's `model` field")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="write results")
    return parser


def run_bench_command(args: argparse.Namespace) -> int:
    from modelhost.bench import BenchConfig, BenchError, format_table, run_bench

    config = BenchConfig(
        url=args.url,
        concurrency=args.concurrency,
        prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens,
        requests=args.requests,
        ignore_eos=args.ignore_eos,
        model=args.model,
        api_key=args.api_key,
    )

    def progress(level: LevelResult) -> None:
        print(
            f"c={level.concurrency}: {level.ok}/{level.requests} ok, "
            f"{level.aggregate_tps:.1f} tok/s",
            file=sys.stderr,
        )

    try:
        report = _run_client(run_bench(config, progress))
    except BenchError as exc:
        print(f"modelhost bench: {exc}", file=sys.stderr)
        return 1
    print(format_table(report))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report.as_json(), indent=2) + "\n")
    return 0 if all(level.ok for level in report.levels) else 1
