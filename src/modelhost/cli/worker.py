"""A worker process: one model, the inference routes, served on a private Unix socket.

The parent (`modelhost serve`) starts one per resident model through `assembly.worker_loader`,
which runs

    python -m modelhost.cli.worker --model PATH --id ID --operations OPS --config JSON --socket PATH

`main` loads the model, builds the same app an in-process model serves (`create_app` over its
stage) and serves it with uvicorn on the socket. The parent made the socket's directory (0700);
the socket itself is bound here under a 0177 umask and set to 0600 before anything listens; so
is the socket beside it on which the parent hands over a client's connection for a stream
(`server/front/stream_handoff`). SIGTERM ends the server the way `modelhost serve` ends (in-flight
requests get their shutdown timeout).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import functools
import gc
import logging
import os
import shutil
import socket
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from modelhost.residency.workers.fork_server import serving_process_gone
from modelhost.residency.workers.private_socket import bind_private_socket
from modelhost.residency.workers.supervisor import PROGRESS_FILE, write_load_progress
from modelhost.residency.workers.worker_startup import STARTUP_FILE, StartupMarks
from modelhost.serve_config import TCP_PORT_FILE, WorkerConfig

if TYPE_CHECKING:
    from modelhost.models.loaded import LoadedModel


def warm_up() -> None:
    """What a worker needs before it can load a model, done ahead by a spare worker
    (residency/workers/spare_process.py): main's imports and the native kernels (a compiler's
    version check, a library load). Not transformers (0.8 CPU-s of a ~3.5 s warm-up on two
    cores): a worker needs it only to convert a GGUF's tokenizer the first time it meets the
    file, which costs seconds anyway."""
    import uvicorn  # noqa: F401

    import modelhost.cli.serve  # noqa: F401
    import modelhost.engine.engine  # noqa: F401
    import modelhost.models.loading.loader  # noqa: F401
    import modelhost.residency.companions  # noqa: F401
    import modelhost.server.app  # noqa: F401
    import modelhost.server.front.stream_handoff  # noqa: F401
    import modelhost.server.http_server  # noqa: F401
    from modelhost.models.kernels.native import kernels

    kernels()


def keep(model: str) -> list[str] | None:
    """Run by the fork server (never by a worker) once `model` has loaded: parse what its next
    load would parse again, for the workers forked after (models/loading/tokenizer_files.py).
    The tokenizer files kept now; None when there was nothing to keep for `model`."""
    from modelhost.models.loading.loader import tokenizer_file
    from modelhost.models.loading.tokenizer_files import keep_tokenizer_file, kept_tokenizer_files

    found = tokenizer_file(Path(model))
    if found is None or not keep_tokenizer_file(found):
        return None
    return kept_tokenizer_files()


def bind_tcp(host: str, port_file: Path) -> socket.socket:
    """A listening TCP socket on `host` at a free port, the port written to `port_file`."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Each token is a small write: without this, Nagle holds one back until the front's delayed
    # ACK (40-200 ms a token). Linux passes the option on to the accepted connections.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, 0))
    sock.listen(128)
    sock.set_inheritable(False)
    port_file.write_text(str(sock.getsockname()[1]))  # read once the worker answers /health
    return sock


def exit_with_parent(socket_path: str, interval_s: float = 1.0) -> None:
    """End this worker (and its socket's directory) when the serving process is gone (its
    parent, or the fork server's parent for a worker forked there: fork_server.py)."""
    gone = serving_process_gone()

    def watch() -> None:
        while not gone():
            time.sleep(interval_s)
        shutil.rmtree(os.path.dirname(socket_path), ignore_errors=True)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def exit_at_once(code: int) -> NoReturn:
    """End the worker without the interpreter's teardown, once its server has shut down (the
    engine closed, the KV store written, the sockets closed). The teardown would free each
    tensor, module and tokenizer object one at a time: 1-2 s of a switch's drain on two cores,
    for memory the kernel takes back at once when the process ends. What an exit must still
    do is done: threads that are not daemons are waited for and the exit handlers run (logging's
    flush among them), as the interpreter would, then the standard streams are flushed."""
    shutdown_threads = getattr(threading, "_shutdown", None)  # the interpreter's own wait
    if shutdown_threads is not None:
        shutdown_threads()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="modelhost-worker")
    parser.add_argument("--socket", required=True)
    parser.add_argument("--model", required=True, help="the model's file or directory")
    parser.add_argument("--id", required=True, help="the registry's stable id")
    parser.add_argument("--mmproj", default=None, help="the GGUF's vision projector, if named")
    parser.add_argument("--operations", default="generate", help="comma-separated, as listed")
    parser.add_argument("--config", default="{}")
    parser.add_argument("--log-level", default="warning")
    parser.add_argument(
        "--listen", default=None, metavar="HOST",
        help="also serve on TCP at HOST (a free port, written beside the socket as "
        f"{TCP_PORT_FILE}), each request needing the cluster secret from the environment",
    )  # fmt: skip
    args = parser.parse_args(argv)
    startup = StartupMarks(Path(args.socket).with_name(STARTUP_FILE))
    startup.mark("main")
    exit_with_parent(args.socket)
    logging.basicConfig(  # its request lines join the parent's log (they share stderr)
        level=getattr(logging, str(args.log_level).upper(), logging.WARNING),
        format=f"%(asctime)s %(levelname)s %(name)s[worker {args.id}]: %(message)s",
    )

    import uvicorn

    from modelhost.assembly import build_stage
    from modelhost.engine.engine import set_threads, share_the_gil_with_the_engine
    from modelhost.models.loading.loader import load_model
    from modelhost.residency.companions import open_stage
    from modelhost.server.app import create_app
    from modelhost.server.front.stream_handoff import (
        SocketReceiver,
        StreamHandoff,
        handoff_socket_path,
    )
    from modelhost.server.http_server import Server

    startup.mark("imported")
    config = WorkerConfig.from_json(args.config)
    set_threads(config.threads)
    settings = config.settings
    operations = args.operations.split(",")
    if "generate" in operations:
        share_the_gil_with_the_engine()
    progress_file = Path(args.socket).with_name(PROGRESS_FILE)  # the parent reads it

    def load(path: str) -> LoadedModel:
        report = functools.partial(write_load_progress, progress_file)
        mmproj = Path(args.mmproj) if args.mmproj else None
        loaded = load_model(path, quantize=config.quantize, progress=report, mmproj=mmproj)
        startup.mark("loaded")
        return loaded

    stage = open_stage(
        Path(args.model),
        args.id,
        operations,
        load,
        lambda model: build_stage(
            model,
            settings,
            batch=config.batch,
            max_queue=config.max_queue,
            quantize=config.quantize,
        ),  # fmt: skip
    )
    startup.mark("engine")
    # The model, its engine and everything imported live as long as this process: frozen, the
    # collector no longer walks them at each full collection during the engine's steps (~1.5%
    # of a prefill's time went to that).
    gc.freeze()
    app = create_app(stage, settings)
    sock = bind_private_socket(args.socket)
    handoff = SocketReceiver(bind_private_socket(handoff_socket_path(args.socket)))
    served: Any = StreamHandoff(app, handoff)
    sockets = [sock]
    if args.listen is not None:  # a cluster node's worker: its front is on another machine
        from modelhost.server.edge.cluster_secret import ClusterSecretGuard, secret_from_env

        served = ClusterSecretGuard(served, secret_from_env() or "")
        sockets.append(bind_tcp(args.listen, Path(args.socket).with_name(TCP_PORT_FILE)))
    uv_config = uvicorn.Config(
        served,
        log_level=args.log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
        lifespan="on",
    )
    Server(uv_config, drain=app.state.drain).run(sockets=sockets)
    exit_at_once(0)


if __name__ == "__main__":
    sys.exit(main())
