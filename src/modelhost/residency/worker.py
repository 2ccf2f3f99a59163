"""A worker process: one model, the inference routes, served on a private Unix socket.

`python -m modelhost.residency.worker --socket PATH --model PATH --id ID --config JSON`
loads the model, builds the same app an in-process model serves (`create_app` over its stage)
and serves it with uvicorn on `PATH`. The parent made the socket's directory (0700); the socket
itself is bound here under a 0177 umask and set to 0600 before anything listens; so is the
socket beside it on which the parent hands over a client's connection for a stream
(`stream_handoff`). SIGTERM ends the server the way `modelhost serve` ends (in-flight requests
get their shutdown timeout).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import socket
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from modelhost.server.app import ServeSettings

SETTING_FIELDS = set(ServeSettings.__dataclass_fields__)


def worker_config(settings: ServeSettings, *, batch: int, max_queue: int) -> str:
    """The `--config` argument: the serving settings and the engine's shape, as JSON."""
    # A worker's socket is its parent's alone, so it checks no key; one on its command line
    # would show in `ps` for every user of the machine.
    shared = {k: v for k, v in asdict(settings).items() if k != "api_key"}
    import torch

    threads = torch.get_num_threads()  # `--threads` reaches the workers too
    config = {"settings": shared, "batch": batch, "max_queue": max_queue, "threads": threads}
    return json.dumps(config)


def bind_private_socket(path: str) -> socket.socket:
    """A listening Unix socket at `path` that only this user can connect to (0600)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    previous = os.umask(0o177)
    try:
        sock.bind(path)
    finally:
        os.umask(previous)
    os.chmod(path, 0o600)
    sock.listen(128)
    sock.set_inheritable(False)
    return sock


def exit_with_parent(socket_path: str, interval_s: float = 1.0) -> None:
    """End this worker (and its socket's directory) when the serving process is gone."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        shutil.rmtree(os.path.dirname(socket_path), ignore_errors=True)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="modelhost-worker")
    parser.add_argument("--socket", required=True)
    parser.add_argument("--model", required=True, help="the model's file or directory")
    parser.add_argument("--id", required=True, help="the registry's stable id")
    parser.add_argument("--operations", default="generate", help="comma-separated, as listed")
    parser.add_argument("--config", default="{}")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    exit_with_parent(args.socket)
    logging.basicConfig(  # its request lines join the parent's log (they share stderr)
        level=getattr(logging, str(args.log_level).upper(), logging.WARNING),
        format=f"%(asctime)s %(levelname)s %(name)s[worker {args.id}]: %(message)s",
    )

    import uvicorn

    from modelhost.cli_serve import build_stage
    from modelhost.models.loader import load_model
    from modelhost.residency.companions import open_stage
    from modelhost.residency.stream_handoff import (
        SocketReceiver,
        StreamHandoff,
        handoff_socket_path,
    )
    from modelhost.server.app import create_app
    from modelhost.server.runner import Server

    config: dict[str, Any] = json.loads(args.config)
    raw = {k: v for k, v in config.get("settings", {}).items() if k in SETTING_FIELDS}
    settings = ServeSettings(**{**raw, "owner": "worker"})
    batch, max_queue = int(config.get("batch", 8)), int(config.get("max_queue", 64))
    if config.get("threads"):
        import torch

        torch.set_num_threads(int(config["threads"]))
    stage = open_stage(
        Path(args.model),
        args.id,
        args.operations.split(","),
        load_model,
        lambda model: build_stage(model, settings, batch=batch, max_queue=max_queue),
    )
    app = create_app(stage, settings)
    sock = bind_private_socket(args.socket)
    handoff = SocketReceiver(bind_private_socket(handoff_socket_path(args.socket)))
    uv_config = uvicorn.Config(
        StreamHandoff(app, handoff),
        log_level=args.log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
        lifespan="on",
    )
    Server(uv_config, drain=app.state.drain).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
