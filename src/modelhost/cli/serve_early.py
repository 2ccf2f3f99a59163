"""What `modelhost serve` starts before it imports the serving code (about a second of Python on
a small machine): the fork server, which imports PyTorch and the worker's modules meanwhile, on
the other core, so that the first model's worker is a fork by the time the front asks for it."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from modelhost.residency.workers.forks import ForkServerHandle
    from modelhost.server.observability.prometheus import WorkerSamples

EarlyStart = tuple["WorkerSamples | None", "ForkServerHandle | None"]


def start_worker_processes(args: argparse.Namespace) -> EarlyStart:
    """For `serve` with worker processes (the default): the directory its workers write their
    request series to, and the fork server started (None with --no-fork-server, off Linux, or
    without workers: in-process or a cluster's front)."""
    if not getattr(args, "workers", False) or getattr(args, "cluster", None):
        return None, None
    from modelhost.residency.workers import WORKER_MODULE
    from modelhost.residency.workers.forks import ForkServerHandle
    from modelhost.server.observability.prometheus import WorkerSamples

    samples = WorkerSamples()
    if not getattr(args, "fork_server", True):
        return samples, None
    forks = ForkServerHandle(WORKER_MODULE, env=samples.env())
    forks.start()
    return samples, forks
