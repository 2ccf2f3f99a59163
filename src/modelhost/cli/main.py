"""`modelhost` command line: parses and wires only; each subcommand is a module of this package
(its parser and its run)."""

from __future__ import annotations

import argparse
import os

from modelhost.cli.bench import add_bench_parser, run_bench_command
from modelhost.cli.generate import add_generate_parser, run_generate
from modelhost.cli.jobs import add_jobs_parser, run_jobs
from modelhost.cli.ls import add_ls_parser, run_ls
from modelhost.cli.serve_args import add_serve_parser


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="modelhost", description="local LLM inference server")
    subparsers = parser.add_subparsers(dest="command", required=True)
    serve = add_serve_parser(subparsers)
    generate = add_generate_parser(subparsers)
    add_ls_parser(subparsers)
    add_bench_parser(subparsers)
    add_jobs_parser(subparsers)
    cores = os.cpu_count() or 1
    generate.add_argument(
        "--threads",
        type=int,
        default=cores,
        help="CPU threads for tensor math (default: all cores)",
    )
    # Serving leaves one core to the HTTP process, which parses, proxies and streams while the
    # engine steps: measured on 2 cores, a second engine thread fighting it for the CPU halved
    # single-stream decode through HTTP (13.5 against 22.1 tok/s) and gained nothing at 8 streams.
    serve.add_argument(
        "--threads", type=int, default=max(1, cores - 1),
        help="CPU threads for tensor math in each model's process (default: all cores but one)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.command == "ls":
        return run_ls(args)
    if args.command == "bench":
        return run_bench_command(args)
    if args.command == "jobs":
        return run_jobs(args)
    if args.command == "serve":
        from modelhost.cli.serve import run_serve  # the server: only to serve

        return run_serve(args)
    return run_generate(args)
