"""A cluster front's `/metrics` adds up the request series its nodes' workers wrote on their own
nodes (`cluster/node_series.py`): each node's agent answers with its sums, the front merges them
into its own series, one set per route whatever node served it. Stand-in agents here (no Ray
cluster); `test_cluster_serving` scrapes a real front."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from modelhost.server.observability.prometheus import Metrics

pytest.importorskip("ray")

from modelhost.cluster import node_series  # noqa: E402
from modelhost.cluster.node_series import NodeSamples, NodeSeries  # noqa: E402

ROUTE = {"route": "/v1/chat/completions"}


def ttft(count: int) -> NodeSamples:
    """A node's answer: `count` first tokens, all under 0.5 s."""
    rows = [("modelhost_time_to_first_token_seconds_bucket", {**ROUTE, "le": "0.5"}, count)]
    rows += [("modelhost_time_to_first_token_seconds_bucket", {**ROUTE, "le": "+Inf"}, count)]
    rows += [("modelhost_time_to_first_token_seconds_count", ROUTE, count)]
    rows += [("modelhost_time_to_first_token_seconds_sum", ROUTE, 0.1 * count)]
    answer: NodeSamples = {"modelhost_time_to_first_token_seconds": rows}
    answer["modelhost_prompt_tokens"] = [("modelhost_prompt_tokens_total", ROUTE, 7.0 * count)]
    return answer


class Agent:
    """`agent.request_series.remote()`: its answer, or a call that never returns."""

    def __init__(self, answer: NodeSamples) -> None:
        self.answer: NodeSamples | None = answer
        self.request_series = self

    def remote(self) -> Any:
        async def run() -> NodeSamples:
            if self.answer is None:
                await asyncio.Event().wait()  # a node that does not answer
            assert self.answer is not None
            return self.answer

        return run()


def scraped(metrics: Metrics) -> dict[str, float]:
    """`/metrics` as the front renders it: sample name -> value, for the chat route."""
    values = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            if sample.labels.get("route") == ROUTE["route"] and "le" not in sample.labels:
                values[sample.name] = sample.value
    return values


async def test_the_fronts_series_add_up_every_nodes_workers():
    agents = {"n1": Agent(ttft(2)), "n2": Agent(ttft(3))}
    metrics = Metrics(SimpleNamespace(), NodeSeries(lambda: agents))
    await metrics.refresh()
    values = scraped(metrics)
    assert values["modelhost_time_to_first_token_seconds_count"] == 5
    assert values["modelhost_prompt_tokens_total"] == 35
    one_set = 'modelhost_time_to_first_token_seconds_count{route="/v1/chat/completions"}'
    assert metrics.render().decode().count(one_set) == 1


async def test_a_node_that_does_not_answer_counts_with_its_last_answer(monkeypatch):
    monkeypatch.setattr(node_series, "FETCH_TIMEOUT_S", 0.05)
    agents = {"n1": Agent(ttft(2)), "n2": Agent(ttft(3))}
    metrics = Metrics(SimpleNamespace(), NodeSeries(lambda: agents))
    await metrics.refresh()
    agents["n1"].answer = ttft(4)
    agents["n2"].answer = None  # stuck: the scrape does not wait for it
    await metrics.refresh()
    assert scraped(metrics)["modelhost_time_to_first_token_seconds_count"] == 7


async def test_a_node_that_left_still_counts_its_requests():
    agents = {"n1": Agent(ttft(2)), "n2": Agent(ttft(3))}
    metrics = Metrics(SimpleNamespace(), NodeSeries(lambda: agents))
    await metrics.refresh()
    del agents["n2"]  # it left the cluster: a counter must not go back
    await metrics.refresh()
    assert scraped(metrics)["modelhost_time_to_first_token_seconds_count"] == 5
