"""`modelhost serve`: load one model, start its engine, and serve the OpenAI surfaces over HTTP.

The CLI wires `add_serve_parser(subparsers)` and calls `run_serve(args)`; tests and embedders
use `build_serving(...)` + `modelhost.server.runner.serve(app, ...)`, or `build_app` directly.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING

from modelhost.inference.admission import BudgetTooSmall
from modelhost.server.app import ServeSettings, admission_policy, build_app
from modelhost.server.runner import serve

if TYPE_CHECKING:
    from fastapi import FastAPI

    from modelhost.models.loaded import LoadedModel

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "serve",
        help="serve a model over OpenAI-compatible HTTP",
        description="Serve one model: POST /v1/chat/completions, /v1/completions; GET /v1/models.",
    )
    parser.add_argument(
        "model", nargs="?", default=None, help="model id or path (default: SmolLM2)"
    )
    parser.add_argument("--host", default=DEFAULT_HOST, help="bind address (default: loopback)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--batch", type=int, default=8, help="rows decoded together")
    parser.add_argument("--max-queue", type=int, default=64, help="waiting rows before 429")
    parser.add_argument(
        "--memory-budget", type=float, default=None, metavar="GB",
        help="decimal GB for weights + KV + working memory; caps the safe context",
    )  # fmt: skip
    parser.add_argument("--context-length", type=int, default=None, metavar="N")
    parser.add_argument("--max-tokens", type=int, default=None, metavar="N")
    parser.add_argument("--temperature", "--temp", type=float, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument(
        "--heartbeat", type=float, default=15.0, metavar="S",
        help="seconds between SSE keep-alive comments on a quiet stream",
    )  # fmt: skip
    parser.add_argument(
        "--shutdown-timeout", type=float, default=10.0, metavar="S",
        help="seconds in-flight requests get to finish on SIGINT/SIGTERM before they are cut",
    )  # fmt: skip
    parser.add_argument("--log-level", default="info")
    return parser


def settings_from_args(args: argparse.Namespace) -> ServeSettings:
    return ServeSettings(
        heartbeat_s=args.heartbeat,
        memory_budget_gb=args.memory_budget,
        context_length=args.context_length,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
    )


def build_serving(
    model: LoadedModel, settings: ServeSettings, *, batch: int = 8, max_queue: int = 64
) -> FastAPI:
    """The engine over `model` (its KV pool sized by the memory budget) and the app over both.

    Raises BudgetTooSmall when --memory-budget cannot hold the weights and any context.
    """
    from modelhost.engine.engine import Engine, EngineConfig

    policy = admission_policy(model, settings, rows=batch)
    config = EngineConfig(
        batch=batch,
        max_queue=max_queue,
        kv_cache_bytes=policy.memory.kv_bytes if policy.memory is not None else None,
        max_num_batched_tokens=settings.chunk_tokens,
        context_length=settings.context_length,
    )
    engine = Engine(model, config)
    try:
        return build_app(engine, model, settings)
    except BaseException:
        engine.close()
        raise


def run_serve(args: argparse.Namespace) -> int:
    from modelhost.models.loader import load_model

    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    settings = settings_from_args(args)
    model = load_model(args.model)
    try:
        app = build_serving(model, settings, batch=args.batch, max_queue=args.max_queue)
    except BudgetTooSmall as exc:
        print(f"modelhost serve: {exc}", file=sys.stderr)
        return 2
    print(f"modelhost: serving {model.id} on http://{args.host}:{args.port}/v1", file=sys.stderr)
    serve(
        app,
        host=args.host,
        port=args.port,
        shutdown_timeout_s=args.shutdown_timeout,
        log_level=args.log_level,
    )
    return 0
