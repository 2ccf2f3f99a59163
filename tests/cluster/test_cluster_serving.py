"""`modelhost serve --cluster` over a Ray cluster simulated on this machine: two nodes, each its own
`ray start` process group and MODELHOST_HOME, the front a `modelhost serve` process, and the
official SDKs as clients.

One cluster for the module (Ray is heavy on two cores). The node `small` (the head) has room
for one worker process (~330 MB resident for a tiny model), `large` for many. Both hold tiny-a
and tiny-b (a context long enough for a stream of many seconds); only `small` holds tiny-c. The
front keeps two replicas of tiny-a. The tests run in file order; the last one kills `large`.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from cluster_nodes import ClusterFront, RayNodes
from prometheus_client.parser import text_string_to_metric_families
from tiny_models import make_tiny_checkpoint

pytest.importorskip("ray")
pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(600)]

SMALL_MB, LARGE_MB = 300, 3000
SPEECH = Path(__file__).resolve().parents[1] / "fixtures" / "audio" / "deliver-umbrellas.en.ogg"
FRONT_ARGUMENTS = ["tiny-a", "--replicas", "tiny-a=2", "--hold", "0"]
LONG_CONTEXT, LONG_TOKENS = 8192, 4000  # tiny-b: a stream that runs for seconds unless cancelled
FIRST_TURN = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]


@pytest.fixture(scope="module")
def cluster(
    models_dir: Path, smollm2: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("cluster")
    only_small = make_tiny_checkpoint(root / "models" / "tiny-c", "qwen3", smollm2)
    long_b = make_tiny_checkpoint(
        root / "models" / "tiny-b", "qwen2", smollm2, max_position_embeddings=LONG_CONTEXT
    )
    shared = [models_dir / "tiny-a", long_b]
    nodes = RayNodes(root, [SMALL_MB, LARGE_MB], [[*shared, only_small], shared]).start()
    world: dict[str, Any] = {"nodes": nodes, "root": root}
    try:
        front = ClusterFront(nodes, FRONT_ARGUMENTS, root / "front").wait_ready()
        world.update(front=front, url=front.base_url)
        members = httpx.get(f"{front.base_url}/stats").json()["models"]["nodes"]
        by_budget = {row["budget_bytes"]: row["node"] for row in members}
        world.update(small=by_budget[SMALL_MB * 1_000_000], large=by_budget[LARGE_MB * 1_000_000])
        yield world
    finally:
        if "front" in world:
            world["front"].stop()
        nodes.stop()


@pytest.fixture(scope="module")
def client(cluster: dict[str, Any]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{cluster['url']}/v1", api_key="x", max_retries=0) as client:
        yield client


def nodes_of(url: str, model_id: str) -> list[str]:
    rows = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
    return sorted(next(row for row in rows if row["id"] == model_id).get("nodes", []))


def chat(url: str, model: str, messages: list[dict[str, str]], **extra: Any) -> httpx.Response:
    body = {"model": model, "messages": messages, "max_tokens": 4, **extra}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=180)
    assert response.status_code == 200, response.text
    return response


def worker_of(url: str, model_id: str) -> dict[str, Any]:
    """The /engine row of `model_id`'s one worker."""
    rows = httpx.get(f"{url}/engine", timeout=10).json()["workers"]
    (row,) = [row for row in rows if row["id"] == model_id]
    return row


def running_rows(url: str, model_id: str) -> float:
    """The rows `model_id`'s worker decodes now, as the front's /metrics reports its worker."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "modelhost_running_rows" and sample.labels["model"] == model_id:
                return sample.value
    raise AssertionError(f"no running rows reported for {model_id}")


def chat_series(url: str) -> dict[str, float]:
    """The request series for the chat route (sample name -> value; buckets, and the front's
    own count of HTTP requests by status, left out), each asserted to be one set whatever nodes
    served it."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            ours = "le" not in labels and "status" not in labels
            if labels.get("route") == "/v1/chat/completions" and ours:
                assert sample.name not in values, f"two {sample.name} series"
                values[sample.name] = sample.value
    return values


def live_row(url: str, request_id: str) -> dict[str, Any] | None:
    """The live view's row of `request_id` (its token figures are its worker's)."""
    with httpx.stream("GET", f"{url}/api/live", timeout=10) as live:
        for line in live.iter_lines():
            if line.startswith("data:"):
                rows = json.loads(line.removeprefix("data:"))["requests"]
                return next((row for row in rows if row["id"] == request_id), None)
    return None


def parent_of(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("PPid:")).split()[1])


def test_a_replicated_model_is_listed_on_two_nodes_with_each_nodes_budget(cluster):
    url = cluster["url"]
    assert nodes_of(url, "tiny-a") == sorted([cluster["small"], cluster["large"]])
    assert nodes_of(url, "tiny-c") == []  # on small's disk, not resident
    models = httpx.get(f"{url}/stats").json()["models"]
    assert {row["node"] for row in models["resident"]} == {cluster["small"], cluster["large"]}
    assert models["budget_bytes"] == (SMALL_MB + LARGE_MB) * 1_000_000
    engine = httpx.get(f"{url}/engine").json()
    assert engine["mode"] == "cluster"
    metrics = httpx.get(f"{url}/metrics").text
    assert metrics.count('modelhost_resident_bytes{model="tiny-a",state="ready"}') == 1
    assert {row["node"] for row in engine["workers"]} == {cluster["small"], cluster["large"]}


def test_the_second_turn_of_a_conversation_goes_to_the_replica_holding_its_prefix(cluster):
    url = cluster["url"]
    first = chat(url, "tiny-a", FIRST_TURN)
    reply = first.json()["choices"][0]["message"]["content"]
    turns = [*FIRST_TURN, {"role": "assistant", "content": reply}]
    second = chat(url, "tiny-a", [*turns, {"role": "user", "content": "And then?"}])
    assert second.headers["x-modelhost-node"] == first.headers["x-modelhost-node"]
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_conversations_are_spread_over_the_replicas(cluster):
    served = {
        chat(
            cluster["url"], "tiny-a", [{"role": "user", "content": f"Topic {i}"}], max_tokens=1
        ).headers["x-modelhost-node"]
        for i in range(12)
    }  # each lands on either replica by its own hash: all on one is 1 in 2048
    assert served == {cluster["small"], cluster["large"]}


def test_requests_served_on_either_node_count_in_the_fronts_request_series(cluster):
    url = cluster["url"]
    before = chat_series(url)
    served, usages = set(), []
    for i in range(40):  # each conversation lands on one replica by its own hash
        reply = chat(url, "tiny-a", [{"role": "user", "content": f"Count {i}"}], max_tokens=2)
        served.add(reply.headers["x-modelhost-node"])
        usages.append(reply.json()["usage"])
        if served == {cluster["small"], cluster["large"]}:
            break
    assert served == {cluster["small"], cluster["large"]}
    after = chat_series(url)

    def rise(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert rise("modelhost_time_to_first_token_seconds_count") == len(usages)
    assert rise("modelhost_e2e_request_latency_seconds_count") == len(usages)
    assert rise("modelhost_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    completion_tokens = sum(u["completion_tokens"] for u in usages)
    assert rise("modelhost_generation_tokens_total") == completion_tokens


def test_each_nodes_workers_keep_their_files_under_that_nodes_home(cluster):
    url, homes = cluster["url"], cluster["nodes"].homes
    members = httpx.get(f"{url}/stats").json()["models"]["nodes"]
    by_node = {row["node"]: row["home"] for row in members}
    assert by_node == {
        cluster["small"]: str(homes[0].resolve()),
        cluster["large"]: str(homes[1].resolve()),
    }
    for row in httpx.get(f"{url}/engine").json()["workers"]:
        environment = Path(f"/proc/{row['pid']}/environ").read_bytes().split(b"\0")
        assert f"MODELHOST_HOME={by_node[row['node']]}".encode() in environment, row


def test_every_sdk_surface_answers_through_the_cluster(cluster, client):
    url = cluster["url"]
    chat_reply = client.chat.completions.create(
        model="tiny-a", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert chat_reply.model == "tiny-a" and chat_reply.usage.completion_tokens > 0
    chunks = list(
        client.chat.completions.create(
            model="tiny-a", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
        )
    )
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    completion = client.completions.create(model="tiny-a", prompt="Once", max_tokens=3)
    assert completion.choices[0].finish_reason in ("stop", "length")
    response = client.responses.create(model="tiny-a", input="hi", max_output_tokens=3)
    assert response.status == "completed" or response.incomplete_details is not None
    embedded = client.embeddings.create(model="all-minilm-l6-v2", input=["a", "b"])
    assert len(embedded.data) == 2 and len(embedded.data[0].embedding) == 384
    with anthropic.Anthropic(base_url=url, api_key="x", max_retries=0) as claude:
        message = claude.messages.create(
            model="tiny-a", max_tokens=3, messages=[{"role": "user", "content": "hi"}]
        )
    assert message.stop_reason in ("end_turn", "max_tokens")
    question = {"type": "predicate", "name": "refund", "instructions": "Money back?"}
    decided = httpx.post(
        f"{url}/v1/decisions",
        json={"model": "tiny-a", "input": "I want a refund", "questions": [question]},
        timeout=120,
    )
    assert decided.status_code == 200, decided.text
    assert [answer["name"] for answer in decided.json()["answers"]] == ["refund"]


def test_speech_is_transcribed_through_the_cluster(cluster, client):
    with SPEECH.open("rb") as clip:
        text = client.audio.transcriptions.create(model="whisper-1", file=clip).text
    assert "umbrellas" in text.lower()


def test_a_front_that_restarts_finds_the_models_resident_on_the_nodes(cluster):
    before = {m: nodes_of(cluster["url"], m) for m in ("tiny-a", "all-minilm-l6-v2")}
    counted = chat_series(cluster["url"])
    os.killpg(cluster["front"].process.pid, signal.SIGKILL)  # no drain: as if it crashed
    cluster["front"].process.wait()
    front = ClusterFront(cluster["nodes"], FRONT_ARGUMENTS, cluster["root"] / "front")
    cluster.update(front=front.wait_ready(), url=front.base_url)
    after = {m: nodes_of(cluster["url"], m) for m in ("tiny-a", "all-minilm-l6-v2")}
    assert after == before
    assert len(after["tiny-a"]) == 2
    engine = httpx.get(f"{cluster['url']}/engine").json()
    assert len([row for row in engine["workers"] if row["id"] == "tiny-a"]) == 2  # none new
    assert chat_series(cluster["url"]) == counted  # the nodes' series, not the front's


def test_a_new_model_loads_on_the_node_with_the_most_free_budget(cluster):
    served = chat(cluster["url"], "tiny-b", FIRST_TURN)
    assert served.headers["x-modelhost-node"] == cluster["large"]
    assert nodes_of(cluster["url"], "tiny-b") == [cluster["large"]]


def test_a_model_only_one_node_has_evicts_there_and_leaves_the_other_node_alone(cluster):
    url = cluster["url"]
    served = chat(url, "tiny-c", FIRST_TURN)
    assert served.headers["x-modelhost-node"] == cluster["small"]
    assert nodes_of(url, "tiny-c") == [cluster["small"]]
    assert nodes_of(url, "tiny-a") == [cluster["large"]]  # small's replica made room
    assert nodes_of(url, "tiny-b") == [cluster["large"]]


def test_a_worker_refuses_a_request_without_the_cluster_secret(cluster):
    workers = httpx.get(f"{cluster['url']}/engine").json()["workers"]
    address = next(row["socket"] for row in workers if row["id"] == "tiny-b")
    assert address.startswith("tcp://")
    base = "http://" + address.removeprefix("tcp://")
    body = {"model": "tiny-b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for headers in ({}, {"x-modelhost-cluster-secret": "a guess"}):
        refused = httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers)
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "cluster_secret_required"
    # A client's own secret header is never passed on: the front's is.
    through = httpx.post(
        f"{cluster['url']}/v1/chat/completions",
        json=body,
        headers={"x-modelhost-cluster-secret": "a guess"},
        timeout=60,
    )
    assert through.status_code == 200


def test_a_client_that_leaves_a_stream_cancels_its_row_on_the_remote_node(cluster):
    url = cluster["url"]
    body = {"model": "tiny-b", "messages": FIRST_TURN, "max_tokens": LONG_TOKENS, "stream": True}
    headers = {"x-request-id": "leaves-early"}
    url_of = f"{url}/v1/chat/completions"
    with httpx.stream("POST", url_of, json=body, headers=headers, timeout=60) as stream:
        assert stream.headers["x-modelhost-node"] == cluster["large"]
        deltas = (line for line in stream.iter_lines() if '"content"' in line)
        assert len([next(deltas) for _ in range(3)]) == 3
        assert running_rows(url, "tiny-b") == 1
    left_at = time.monotonic()
    while running_rows(url, "tiny-b") != 0:
        assert time.monotonic() - left_at < 5, "the remote row still decodes"
        time.sleep(0.1)
    # Finished rather than cancelled, the row would have produced all its tokens.
    deadline = time.monotonic() + 10
    while (row := live_row(url, "leaves-early")) is None or row["completion_tokens"] is None:
        assert time.monotonic() < deadline, row
        time.sleep(0.2)
    assert row["status"] == 499
    assert 3 <= row["completion_tokens"] < LONG_TOKENS


def test_a_worker_actor_that_crashes_is_replaced_on_its_node_under_the_restart_rule(cluster):
    url = cluster["url"]
    before = worker_of(url, "tiny-b")
    actor_pid = parent_of(before["pid"])  # the ModelWorker actor that spawned the worker
    assert "ModelWorker" in Path(f"/proc/{actor_pid}/cmdline").read_text()
    body = {"model": "tiny-b", "messages": FIRST_TURN, "max_tokens": LONG_TOKENS, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as stream:
        lines = stream.iter_lines()
        frames = [next(line for line in lines if line.startswith("data:"))]
        os.kill(actor_pid, signal.SIGKILL)  # its worker exits with it
        frames += [line for line in lines if line.startswith("data:")]
    last = json.loads(frames[-1].removeprefix("data:"))
    assert last["error"]["code"] == "engine_unavailable", frames[-3:]
    again = chat(url, "tiny-b", FIRST_TURN)  # a new actor, on the same node
    assert again.headers["x-modelhost-node"] == cluster["large"]
    after = worker_of(url, "tiny-b")
    assert after["node"] == cluster["large"] and after["pid"] != before["pid"]
    assert after["restarts"] == before["restarts"] + 1  # counted as a local worker's restart
    assert parent_of(after["pid"]) != actor_pid


def test_a_worker_actor_that_dies_while_idle_is_replaced_without_waiting_for_a_request(cluster):
    url = cluster["url"]
    before = worker_of(url, "tiny-b")
    os.kill(parent_of(before["pid"]), signal.SIGKILL)  # its ModelWorker actor
    killed_at = time.monotonic()
    while (row := worker_of(url, "tiny-b"))["restarts"] == before["restarts"]:
        assert time.monotonic() - killed_at < 15, "the membership loop did not notice"
        time.sleep(0.2)
    while row["pid"] == before["pid"] or row["worker_state"] != "ready":
        assert time.monotonic() - killed_at < 180, row  # a new actor loads the model
        time.sleep(0.5)
        row = worker_of(url, "tiny-b")
    assert row["node"] == cluster["large"] and row["restarts"] == before["restarts"] + 1
    assert chat(url, "tiny-b", FIRST_TURN).headers["x-modelhost-node"] == cluster["large"]


def test_a_node_that_dies_mid_stream_ends_it_with_the_error_frame_and_its_model_moves(cluster):
    url, nodes = cluster["url"], cluster["nodes"]
    workers = httpx.get(f"{url}/engine").json()["workers"]
    pids = [row["pid"] for row in workers if row["node"] == cluster["large"]]
    body = {"model": "tiny-b", "messages": FIRST_TURN, "max_tokens": 400, "stream": True}
    frames = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as stream:
        assert stream.headers["x-modelhost-node"] == cluster["large"]
        lines = stream.iter_lines()
        frames.append(next(line for line in lines if line.startswith("data:")))
        nodes.kill(1)  # the large node's Ray processes, and the worker processes on it
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        frames += [line for line in lines if line.startswith("data:")]
    killed_at = time.monotonic()
    last = json.loads(frames[-1].removeprefix("data:"))
    assert last["error"]["code"] == "engine_unavailable", frames[-3:]
    while cluster["large"] in nodes_of(url, "tiny-b"):
        assert time.monotonic() - killed_at < 10, "the dead node is still listed"
        time.sleep(0.5)
    moved = chat(url, "tiny-b", FIRST_TURN)
    assert moved.headers["x-modelhost-node"] == cluster["small"]
    assert nodes_of(url, "tiny-b") == [cluster["small"]]
