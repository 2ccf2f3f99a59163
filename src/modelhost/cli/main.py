"""`modelhost` command line: parses and wires only. Each subcommand is a module of this package
(its parser and its run); `generate`, one-shot and small, lives here."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

from modelhost.cli.bench import add_bench_parser, run_bench_command
from modelhost.cli.cache import add_cache_parser, run_cache
from modelhost.cli.jobs import add_jobs_parser, run_jobs
from modelhost.cli.ls import add_ls_parser, run_ls
from modelhost.cli.pull import add_pull_parser, run_pull
from modelhost.cli.serve_args import add_serve_parser
from modelhost.cli.serve_early import start_worker_processes
from modelhost.models.modes import HELP as QUANTIZE_HELP
from modelhost.models.modes import MODES


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand's parser (docs/configuration.md's flags table is checked against it)."""
    parser = argparse.ArgumentParser(prog="modelhost", description="local LLM inference server")
    subparsers = parser.add_subparsers(dest="command", required=True)
    serve = add_serve_parser(subparsers)
    generate = _add_generate_parser(subparsers)
    add_ls_parser(subparsers)
    add_pull_parser(subparsers)
    add_bench_parser(subparsers)
    add_jobs_parser(subparsers)
    add_cache_parser(subparsers)
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "ls":
        return run_ls(args)
    if args.command == "pull":
        return run_pull(args)
    if args.command == "bench":
        return run_bench_command(args)
    if args.command == "jobs":
        return run_jobs(args)
    if args.command == "cache":
        return run_cache(args)
    if args.command == "serve":
        # First the fork server: it imports PyTorch while this process imports the server.
        started = start_worker_processes(args)
        from modelhost.cli.serve import run_serve  # the server: only to serve

        return run_serve(args, started)
    return run_generate(args)


def _add_generate_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("generate", help="one-shot generation streamed to the terminal")
    parser.add_argument("model", nargs="?", default=None, help="model id or path (default SmolLM2)")
    parser.add_argument("-p", "--prompt", required=True)
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", "--temp", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--quantize", choices=MODES, default=None, help=QUANTIZE_HELP)
    return parser


def run_generate(args: argparse.Namespace) -> int:
    from modelhost.cli.progress import load_reporter
    from modelhost.engine.engine import (
        Engine,
        EngineConfig,
        set_threads,
        share_the_gil_with_the_engine,
    )
    from modelhost.engine.sampling.sampling_params import SamplingParams
    from modelhost.models.loading.loader import ModelNotFound, load_model
    from modelhost.models.loading.weights import UnsupportedTensor

    set_threads(args.threads)
    try:
        label = args.model or "the default model"
        model = load_model(args.model, quantize=args.quantize, progress=load_reporter(label))
    except (ModelNotFound, UnsupportedTensor) as exc:
        print(f"modelhost generate: {exc}", file=sys.stderr)
        return 2
    tokenizer = model.tokenizer
    if args.chat:
        prompt_ids = tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    else:
        prompt_ids = tokenizer.encode(args.prompt)
    temperature = args.temperature
    if temperature is None:
        temperature = min(model.gen_defaults.get("temperature", 0.7), 0.7)
    params = SamplingParams(temperature=temperature, max_tokens=args.max_tokens, seed=args.seed)
    share_the_gil_with_the_engine()
    engine = Engine(model, EngineConfig(batch=1))
    try:
        first_s, total_s, num_tokens = asyncio.run(_stream(engine, prompt_ids, params))
    finally:
        engine.close()
    decode_tps = (num_tokens - 1) / (total_s - first_s) if num_tokens > 1 else 0.0
    print(
        f"\n[{model.id}] prompt {len(prompt_ids)} tokens, {len(prompt_ids) / first_s:.1f} tok/s; "
        f"decode {num_tokens} tokens, {decode_tps:.1f} tok/s",
        file=sys.stderr,
    )
    return 0


async def _stream(engine, prompt_ids: list[int], params) -> tuple[float, float, int]:
    started = time.perf_counter()
    first_s = 0.0
    num_tokens = 0
    async for event in engine.submit(prompt_ids, params):
        if num_tokens == 0 and event.token_ids:
            first_s = time.perf_counter() - started
        num_tokens += len(event.token_ids)
        sys.stdout.write(event.text)
        sys.stdout.flush()
    return first_s, time.perf_counter() - started, num_tokens
