"""`modelhost serve --cluster HEAD:PORT`: this process joins the Ray cluster as its front.

The front serves the same app as a single machine (`assembly.serve_router`): one port, every
protocol, the same access guard and API key. Its router leases from a `ClusterHost` (one
residency host per node, `residency/cluster.py`), which `Membership` keeps current; each
resident model is a `ModelWorker` actor's worker process on its node, reached over TCP with the
cluster secret.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from modelhost.cluster.membership import NAMESPACE, Membership, cluster_secret
from modelhost.cluster.node_series import NodeSeries
from modelhost.cluster.remote_unit import RemoteWorkerUnit
from modelhost.inference.admission import BYTES_PER_GB
from modelhost.models.loading.embedded import DEFAULT_MODEL
from modelhost.residency.cluster import ClusterHost, ClusterRegistry
from modelhost.residency.registry import ModelEntry
from modelhost.residency.router import ModelRouter
from modelhost.residency.unit import ResidencyError
from modelhost.serve_config import parse_replicas, serving_shape
from modelhost.server.edge.cluster_secret import read_token_file
from modelhost.server.settings import ServeSettings


def find_model(registry: ClusterRegistry, name: str) -> ModelEntry | None:
    """A `serve` argument: a model id on some node, or the path some node found it at."""
    entry = registry.get(name)
    if entry is not None:
        return entry
    wanted = Path(name).expanduser()
    for candidate in registry.entries():
        if candidate.path == wanted or candidate.path.name == wanted.name:
            return candidate
    return None


def run_cluster(
    args: argparse.Namespace,
    settings: ServeSettings,
    *,
    worker_arguments: Callable[[ModelEntry], list[str]],
    serve: Callable[..., int],
) -> int:
    """Join the cluster and serve its front: `worker_arguments` is every node's worker launch,
    `serve(settings, router, start, mode, samples)` the app a single machine serves
    (`assembly.serve_router`)."""
    replicas = parse_replicas(args.replicas)
    token = read_token_file(args.cluster_token_file) if args.cluster_token_file else None
    try:
        ray.init(
            address=args.cluster,
            namespace=NAMESPACE,
            logging_level=logging.WARNING,
            log_to_driver=False,
        )
    except (ConnectionError, RuntimeError, ValueError) as exc:
        print(f"modelhost serve: cannot join the cluster at {args.cluster}: {exc}", file=sys.stderr)
        return 2
    try:
        secret = cluster_secret(token)
        return _serve(args, settings, replicas, secret, worker_arguments, serve)
    finally:
        ray.shutdown()


def _serve(
    args: argparse.Namespace,
    settings: ServeSettings,
    replicas: dict[str, int],
    secret: str,
    worker_arguments: Callable[[ModelEntry], list[str]],
    serve: Callable[..., int],
) -> int:
    names = list(args.models) or [DEFAULT_MODEL]
    cluster: ClusterHost[RemoteWorkerUnit] = ClusterHost(replicas=replicas)
    registry = ClusterRegistry(cluster.live_nodes)
    membership = Membership(
        cluster,
        secret=secret,
        worker_arguments=worker_arguments,
        shape=serving_shape(args, settings),
        paths=[name for name in names if "/" in name or name.endswith(".gguf")],
        node_budget_bytes=int(args.node_budget * BYTES_PER_GB) if args.node_budget else None,
        hold_s=args.hold,
    )
    router: ModelRouter[Any] = ModelRouter(cluster, registry, current=names[0])

    async def start(host: Any) -> None:
        await membership.wait_for_nodes()
        if not cluster.nodes:
            message = f"no node of the cluster at {args.cluster} can serve models"
            print(f"modelhost serve: {message}", file=sys.stderr)
            raise ResidencyError("does-not-fit", message)
        startup = find_model(registry, names[0])
        if startup is None:
            message = f"model '{names[0]}' is on no node (see `modelhost ls` on each)"
            print(f"modelhost serve: {message}", file=sys.stderr)
            raise ResidencyError("does-not-fit", message)
        router.current = startup.id
        cluster.replicas = {
            (entry.id if (entry := find_model(registry, m)) else m): n for m, n in replicas.items()
        }
        try:
            async with await router.acquire(startup.id):
                pass
        except ResidencyError as exc:
            print(f"modelhost serve: {exc.message}", file=sys.stderr)
            raise
        await cluster.maintain()  # the replicas asked for, before the port opens
        cluster.run_beside(membership.run())

    series = NodeSeries(membership.agents)  # the workers' request series, for /metrics
    return serve(settings, router, start, f", cluster at {args.cluster}", series)
