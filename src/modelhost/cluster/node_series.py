"""The request series of workers on other nodes, for the front's `/metrics`.

A node's workers write their request series (time to first token, inter-token, end to end,
queue, tokens) to files on their own node, as a single machine's workers do on theirs
(prometheus-client's multiprocess mode): every worker a node's actors start writes to that
node's directory (`samples_directory`, in the node's Ray session folder). When the front is
scraped, `NodeSeries` asks each node's agent for the sums of its directory (at most
`FETCH_TIMEOUT_S`, all nodes at once) and adds the nodes up, so a model's series are one set
whatever node served it. A node that does not answer in time counts with its last answer, and so
does one that left: its requests happened, and a counter must not go back.

The directory belongs to the node, not to the front: a front that restarts adopts the workers
the previous one started and reads their series (and the evicted workers' before them) too.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client.core import Metric
from prometheus_client.samples import Sample

from modelhost.cluster.remote_unit import call

FETCH_TIMEOUT_S = 2.0

# A node's answer: family name -> its samples as (sample name, labels, value), plain data for Ray.
NodeSamples = dict[str, list[tuple[str, dict[str, str], float]]]


def samples_directory(temp_dir: str, session_name: str, node_id: str) -> Path:
    """Where the workers of node `node_id` write their series: a folder of the node's Ray
    session (it goes with Ray's own files), one per node (simulated nodes share a machine)."""
    return Path(temp_dir) / session_name / "modelhost-metrics" / node_id


def plain_samples(families: dict[str, Metric]) -> NodeSamples:
    return {
        name: [(s.name, dict(s.labels), float(s.value)) for s in family.samples]
        for name, family in families.items()
    }


class NodeSeries:
    """The front's `SampleSource` in a cluster: the last answer of each node's agent."""

    def __init__(self, agents: Callable[[], dict[str, Any]]) -> None:
        self._agents = agents  # node id -> its NodeAgent, the members now
        self._last: dict[str, NodeSamples] = {}

    async def refresh(self) -> None:
        async def fetch(node_id: str, agent: Any) -> None:
            with contextlib.suppress(ConnectionError):
                answer = await call(agent.request_series.remote(), FETCH_TIMEOUT_S)
                self._last[node_id] = answer

        await asyncio.gather(*(fetch(n, agent) for n, agent in self._agents().items()))

    def families(self) -> dict[str, Metric]:
        merged: dict[str, Metric] = {}
        for answer in self._last.values():
            for name, samples in answer.items():
                family = merged.setdefault(name, Metric(name, "", "unknown"))
                family.samples += [Sample(n, labels, value) for n, labels, value in samples]
        return merged

    def close(self) -> None:
        """Nothing to remove: the files are the nodes'."""
