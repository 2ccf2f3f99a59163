"""Worker processes end to end: tiny models served from their own processes behind one port."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from live_server import LiveServer, open_tcp_fds
from prometheus_client.parser import text_string_to_metric_families

from modelhost.assembly import worker_loader
from modelhost.audio.whisper_files import WHISPER_BASE
from modelhost.models.loading.embedded import EMBEDDING_MODEL
from modelhost.residency.host import ResidencyHost
from modelhost.residency.registry import ModelRegistry, ServingShape
from modelhost.residency.router import ModelRouter
from modelhost.residency.workers.forks import ForkServerHandle, fork_server_supported
from modelhost.residency.workers.supervisor import MAX_RESTARTS
from modelhost.residency.workers.worker_unit import WorkerUnit
from modelhost.serve_config import WORKER_MODULE
from modelhost.server.app import create_routed_app
from modelhost.server.front.worker_proxy import PID_HEADER
from modelhost.server.observability.prometheus import WorkerSamples
from modelhost.server.settings import ServeSettings

pytestmark = pytest.mark.slow
SHAPE = ServingShape(batch=2)
WAIT_S = 60.0
ENGLISH = Path(__file__).resolve().parents[1] / "fixtures" / "audio" / "deliver-umbrellas.en.ogg"


@pytest.fixture
def served(models_dir, tmp_path, request) -> Iterator[dict[str, Any]]:
    """A server of worker processes; `forked` (param): forked from a fork server, as `modelhost
    serve` starts them, instead of spawned."""
    options = getattr(request, "param", {})
    max_restarts = options.get("max_restarts", MAX_RESTARTS)
    registry = ModelRegistry(
        [models_dir], home=tmp_path / "home", hf_hub=tmp_path / "hub", embedded=False, shape=SHAPE
    )
    settings = ServeSettings()
    samples = WorkerSamples()  # as `modelhost serve` wires its workers
    if options.get("forked") and not fork_server_supported():
        pytest.skip("the fork server needs Linux")
    forks = ForkServerHandle(WORKER_MODULE, env=samples.env()) if options.get("forked") else None
    if forks is not None:
        forks.start()
    load = worker_loader(
        settings, batch=2, start_timeout_s=WAIT_S, max_restarts=max_restarts, env=samples.env(),
        forks=forks,
    )  # fmt: skip
    host: ResidencyHost[WorkerUnit] = ResidencyHost(
        budget_bytes=10**12, source=registry.get, load=load, hold_s=0.0
    )
    router = ModelRouter(host, registry, current="tiny-a")
    pids: list[int] = []
    world: dict[str, Any] = {"host": host, "pids": pids, "forked": forks is not None}
    app = create_routed_app(router, settings, worker_samples=samples)
    with LiveServer(app) as server:
        world["url"] = server.base_url
        with httpx.Client(base_url=server.base_url, timeout=WAIT_S) as client:
            world["client"] = client
            yield world
    assert host.resident() == []
    if forks is not None:
        assert forks.process is not None
        pids.append(forks.process.pid)
        forks.close()
    for pid in pids:
        assert not process_alive(pid), f"process {pid} outlived the server"


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    try:
        return "State:\tZ" not in status.read_text()
    except OSError:
        return False


def wait_gone(pid: int) -> None:
    deadline = time.monotonic() + 15
    while process_alive(pid):
        assert time.monotonic() < deadline, f"process {pid} is still running"
        time.sleep(0.05)


def chat(client: httpx.Client, model: str, **extra: Any) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return client.post("/v1/chat/completions", json={**body, **extra})


def unit_of(world: dict[str, Any], model_id: str) -> WorkerUnit:
    unit = world["host"].peek(model_id)
    assert unit is not None
    world["pids"].append(unit.pid)
    assert unit.worker.forked is world["forked"]  # forked where the fork server runs
    return unit  # type: ignore[no-any-return]


# The tests that kill or stop a worker, run with spawned workers and with forked ones.
SPAWNED_AND_FORKED = pytest.mark.parametrize(
    "served", [{}, {"forked": True}], indirect=True, ids=["spawned", "forked"]
)


def test_a_worker_process_answers_on_a_private_socket(served):
    client = served["client"]
    reply = chat(client, "tiny-a")
    assert reply.status_code == 200, reply.text
    assert reply.json()["model"] == "tiny-a"
    pid = int(reply.headers[PID_HEADER])
    assert pid != os.getpid()
    for singleton in ("date", "server", "content-type"):  # the worker's are not relayed again
        assert len(reply.headers.get_list(singleton)) == 1, singleton
    unit = unit_of(served, "tiny-a")
    assert unit.pid == pid
    socket_path = Path(unit.worker.socket_path)
    assert stat.S_ISSOCK(socket_path.stat().st_mode)
    assert stat.S_IMODE(socket_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(socket_path.parent.stat().st_mode) == 0o700
    stats = client.get("/stats").json()
    assert stats["worker"]["pid"] == pid
    resident = stats["models"]["resident"][0]
    assert resident["bytes"] >= unit.weights_bytes  # the RSS, never below the weights


@SPAWNED_AND_FORKED
def test_a_worker_killed_mid_stream_ends_with_one_error_frame_and_is_respawned(served):
    client = served["client"]
    assert chat(client, "tiny-a").status_code == 200
    unit = unit_of(served, "tiny-a")
    first_pid = unit.pid
    body = {
        "model": "tiny-a",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
    }
    frames: list[str] = []
    with client.stream("POST", "/v1/chat/completions", json=body) as stream:
        assert stream.status_code == 200
        killed = False
        for line in stream.iter_lines():
            if not line.startswith("data: "):
                continue
            frames.append(line)
            if not killed:
                os.kill(first_pid, signal.SIGKILL)
                killed = True
    errors = [f for f in frames if '"error"' in f]
    assert len(errors) == 1, frames[-3:]
    assert frames[-1] == errors[0]
    error = json.loads(errors[0][len("data: ") :])["error"]
    assert error["code"] == "engine_unavailable"
    reply = chat(client, "tiny-a")
    assert reply.status_code == 200, reply.text
    assert int(reply.headers[PID_HEADER]) != first_pid
    assert unit.worker.restarts == 1
    served["pids"].append(unit.pid)


def handed_off_streams(client: httpx.Client) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("modelhost_worker_streams_handed_off_total "):
            return float(line.split()[1])
    raise AssertionError("the handed-off streams are not counted")


def stream_body(model: str) -> bytes:
    messages = [{"role": "user", "content": "hi"}]
    body = {"model": model, "messages": messages, "max_tokens": 6, "stream": True}
    return json.dumps(body).encode()


def test_a_workers_stream_goes_straight_to_the_client_and_its_connection_serves_the_next_request(
    served,
):
    before = handed_off_streams(served["client"])
    port = int(served["url"].rsplit(":", 1)[1])
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
    try:
        headers = {"content-type": "application/json"}
        connection.request("POST", "/v1/chat/completions", stream_body("tiny-a"), headers)
        streamed = connection.getresponse()
        assert streamed.status == 200 and streamed.getheader("transfer-encoding") == "chunked"
        frames = [line for line in streamed.read().decode().splitlines() if line]
        assert frames[-1] == "data: [DONE]" and '"usage"' in frames[-2]
        first_socket = connection.sock
        body = json.dumps({"model": "tiny-a", "prompt": "hi", "max_tokens": 2}).encode()
        connection.request("POST", "/v1/completions", body, headers)
        answered = connection.getresponse()
        assert answered.status == 200 and json.loads(answered.read())["object"] == "text_completion"
        assert connection.sock is first_socket  # the same keep-alive connection
    finally:
        connection.close()
    assert handed_off_streams(served["client"]) == before + 1
    assert open_tcp_fds(unit_of(served, "tiny-a").pid) == 0  # its copy of the socket is closed


def test_an_http_1_0_client_gets_a_workers_stream_relayed_to_the_end(served):
    before = handed_off_streams(served["client"])
    port = int(served["url"].rsplit(":", 1)[1])
    body = stream_body("tiny-a")
    request = (
        b"POST /v1/chat/completions HTTP/1.0\r\nhost: 127.0.0.1\r\n"
        b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%b" % (len(body), body)
    )
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as raw:
        raw.sendall(request)
        answer = b""
        while chunk := raw.recv(65536):  # HTTP/1.0: the body ends when the server closes
            answer += chunk
    head, _, content = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"connection: close" in head.lower()
    assert content.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")  # uvicorn chunks it still
    assert handed_off_streams(served["client"]) == before


@SPAWNED_AND_FORKED
def test_evicting_a_model_stops_its_worker_and_removes_its_socket(served):
    client = served["client"]
    assert chat(client, "tiny-b").status_code == 200
    unit = unit_of(served, "tiny-b")
    pid, directory = unit.pid, Path(unit.worker.socket_path).parent
    reply = client.post("/api/models/tiny-b/unload")
    assert reply.status_code == 200, reply.text
    wait_gone(pid)
    assert not directory.exists()
    assert served["host"].peek("tiny-b") is None


def test_a_stored_response_is_retrieved_from_the_worker_that_created_it(served):
    client = served["client"]
    created = client.post(
        "/v1/responses", json={"model": "tiny-a", "input": "hi", "max_output_tokens": 3}
    )
    assert created.status_code == 200, created.text
    unit_of(served, "tiny-a")
    response_id = created.json()["id"]
    fetched = client.get(f"/v1/responses/{response_id}")
    assert fetched.status_code == 200 and fetched.json()["id"] == response_id
    missing = client.get("/v1/responses/resp_nope")
    assert missing.status_code == 404 and "error" in missing.json()


def test_the_engine_route_lists_each_resident_models_worker(served):
    client = served["client"]
    assert chat(client, "tiny-a").status_code == 200
    pid = unit_of(served, "tiny-a").pid
    engine = client.get("/engine").json()
    (row,) = engine["workers"]
    startup = row.pop("startup")  # where its start went, in ms
    assert row == {
        "id": "tiny-a", "role": "primary", "state": "ready", "pid": pid,
        "worker_state": "ready", "restarts": 0,
        "socket": unit_of(served, "tiny-a").worker.socket_path, "from_spare": False,
        "forked": False,
    }  # fmt: skip
    assert set(startup) == {
        "spare_wait_ms", "python_ms", "imports_ms", "weights_ms", "engine_ms", "listen_ms"
    }  # fmt: skip
    assert engine["spare"] is None  # this server keeps no spare worker
    assert engine["fork_server"] is None  # nor a fork server


def test_the_workers_private_routes_exist_on_its_socket_and_not_on_the_port(served):
    client = served["client"]
    assert chat(client, "tiny-a").status_code == 200
    assert client.post("/admin/drain", json={}).status_code == 404
    socket_path = unit_of(served, "tiny-a").worker.socket_path
    transport = httpx.HTTPTransport(uds=socket_path)
    with httpx.Client(transport=transport, base_url="http://worker", timeout=WAIT_S) as private:
        memory = {
            "call": "completeBatch",
            "requests": [
                {"input": {"system": "Be brief.", "user": "hi"}, "maxTokens": 2},
                {"input": {"user": "hello"}, "maxTokens": 3},
            ],
        }
        outputs = private.post("/admin/memory/complete", json=memory).json()["outputs"]
        assert len(outputs) == 2 and all(isinstance(text, str) for text in outputs)
        with private.stream("GET", "/admin/events") as events:
            first = json.loads(next(events.iter_lines()))
        assert first["type"] == "worker.memory" and first["resident_bytes"] > 0
        given = private.post("/admin/give-back").json()  # idle: its KV pool goes back
        assert given["given_back"] is True and given["resident_bytes"] > 0
        drained = private.post("/admin/drain", json={"timeout_ms": 1000}).json()
        assert drained == {"drained": True, "in_flight": 0, "pid": unit_of(served, "tiny-a").pid}
        refused = private.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
        )
        assert refused.status_code == 503  # a drained worker admits nothing new


@pytest.mark.parametrize(  # one restart allowed in the window
    "served", [{"max_restarts": 1}, {"max_restarts": 1, "forked": True}], indirect=True,
    ids=["spawned", "forked"],
)  # fmt: skip
def test_a_worker_out_of_restarts_is_evicted_and_respawned_on_the_next_request(served):
    client = served["client"]
    assert chat(client, "tiny-a").status_code == 200
    first = unit_of(served, "tiny-a")
    os.kill(first.pid, signal.SIGKILL)
    wait_gone(first.pid)
    assert chat(client, "tiny-a").status_code == 200  # respawned: its one restart
    assert first.worker.restarts == 1
    second_pid = unit_of(served, "tiny-a").pid
    os.kill(second_pid, signal.SIGKILL)
    deadline = time.monotonic() + 15
    while first.worker.alive():  # reaped only once all its threads have exited
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert first.broken()  # dead, and out of restarts
    reply = chat(client, "tiny-a")
    assert reply.status_code == 200, reply.text
    fresh = unit_of(served, "tiny-a")
    assert fresh is not first and fresh.worker.restarts == 0
    assert int(reply.headers[PID_HEADER]) == fresh.pid


def scraped(client: httpx.Client, name: str, route: str = "/v1/chat/completions") -> float:
    """The value of sample `name` for `route` in a scrape of the front's /metrics."""
    text = client.get("/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels.get("route") == route:
                return float(sample.value)
    return 0.0


def test_a_scrape_of_the_front_sees_the_requests_every_worker_served(served):
    client = served["client"]
    generated = 0
    for model in ("tiny-a", "tiny-b"):  # two worker processes
        reply = chat(client, model, ignore_eos=True)
        assert reply.status_code == 200, reply.text
        generated += reply.json()["usage"]["completion_tokens"]
    body = {"model": "tiny-b", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with client.stream("POST", "/v1/chat/completions", json={**body, "max_tokens": 4}) as stream:
        assert stream.status_code == 200
        frames = [json.loads(line[6:]) for line in stream.iter_lines() if line[6:7] == "{"]
    generated += frames[-1]["usage"]["completion_tokens"]
    assert scraped(client, "modelhost_time_to_first_token_seconds_count") == 3
    assert scraped(client, "modelhost_e2e_request_latency_seconds_count") == 3
    assert scraped(client, "modelhost_inter_token_latency_seconds_count") >= 2
    assert scraped(client, "modelhost_generation_tokens_total") == generated


@SPAWNED_AND_FORKED
def test_a_workers_requests_still_count_after_it_was_killed_and_respawned(served):
    client = served["client"]
    assert chat(client, "tiny-a").status_code == 200
    first_pid = unit_of(served, "tiny-a").pid
    assert first_pid is not None
    os.kill(first_pid, signal.SIGKILL)
    wait_gone(first_pid)
    assert chat(client, "tiny-a").status_code == 200  # served by its respawned worker
    assert unit_of(served, "tiny-a").pid != first_pid
    assert scraped(client, "modelhost_time_to_first_token_seconds_count") == 2


def sdk(world: dict[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{world['url']}/v1", api_key="-", max_retries=0, timeout=WAIT_S)


def wait_unleased(host: ResidencyHost[Any], model_id: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while any(m.leases for m in host.resident() if m.id == model_id):
        assert time.monotonic() < deadline, f"{model_id} is still leased"
        time.sleep(0.01)


def test_a_responses_chain_survives_its_worker_being_evicted_between_turns(served):
    turn: dict[str, Any] = {"model": "tiny-a", "max_output_tokens": 4}
    with sdk(served) as client:
        first = client.responses.create(**turn, input="Name a colour.")
        # The lease ends as the body's last bytes leave, just after the client has them.
        wait_unleased(served["host"], "tiny-a")
        unload = served["client"].post("/api/models/tiny-a/unload")
        assert unload.status_code == 200 and served["host"].peek("tiny-a") is None
        second = client.responses.create(**turn, input="Another?", previous_response_id=first.id)
        alone = client.responses.create(**turn, input="Another?", store=False)
        assert client.responses.retrieve(first.id).output_text == first.output_text
    assert second.previous_response_id == first.id
    assert second.usage is not None and alone.usage is not None
    assert second.usage.input_tokens > alone.usage.input_tokens  # the first turn was in it


@SPAWNED_AND_FORKED
def test_a_streamed_responses_turn_chains_on_after_its_worker_was_killed(served):
    turn: dict[str, Any] = {"model": "tiny-a", "max_output_tokens": 4}
    with sdk(served) as client:
        with client.responses.create(**turn, input="Name a colour.", stream=True) as events:
            # four tokens cut the answer: the stream ends with response.incomplete
            completed = [e for e in events if e.type == "response.incomplete"]
        first_id = completed[0].response.id
        pid = unit_of(served, "tiny-a").pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        wait_gone(pid)
        second = client.responses.create(**turn, input="Another?", previous_response_id=first_id)
    assert second.previous_response_id == first_id
    assert unit_of(served, "tiny-a").pid != pid  # a respawned worker answered


def test_companion_models_run_in_worker_processes_too(models_dir, tmp_path):
    registry = ModelRegistry([models_dir], home=tmp_path / "home", hf_hub=tmp_path / "hub")
    settings = ServeSettings()
    host: ResidencyHost[WorkerUnit] = ResidencyHost(
        budget_bytes=10**12,
        source=registry.get,
        load=worker_loader(settings, batch=2, start_timeout_s=WAIT_S),
    )
    router = ModelRouter(host, registry, current="tiny-a")
    with (
        LiveServer(create_routed_app(router, settings)) as server,
        httpx.Client(base_url=server.base_url, timeout=WAIT_S) as client,
    ):
        embedded = client.post("/v1/embeddings", json={"input": ["a cat", "a dog"]})
        assert embedded.status_code == 200, embedded.text
        assert embedded.json()["model"] == EMBEDDING_MODEL
        with ENGLISH.open("rb") as audio:
            heard = client.post("/v1/audio/transcriptions", files={"file": audio})
        assert heard.status_code == 200, heard.text
        assert "umbrellas" in heard.json()["text"].lower()
        pids = {int(r.headers[PID_HEADER]) for r in (embedded, heard)}
        assert len(pids) == 2 and os.getpid() not in pids  # each in its own process
        workers = {w["id"]: w for w in client.get("/engine").json()["workers"]}
        assert workers[EMBEDDING_MODEL]["role"] == workers[WHISPER_BASE]["role"] == "companion"
    assert host.resident() == []
    for pid in pids:
        wait_gone(pid)


def test_the_live_stream_shows_the_tokens_of_a_request_a_worker_answered(served):
    client = served["client"]
    reply = chat(client, "tiny-a", ignore_eos=True)
    assert reply.status_code == 200, reply.text
    with client.stream("GET", "/api/live") as live:
        frames = (json.loads(line[6:]) for line in live.iter_lines() if line[:6] == "data: ")
        # The front may still be closing the relayed answer as the first snapshot goes out.
        snapshot = next(s for s in frames if not s["requests"][0]["in_flight"])
    row = snapshot["requests"][0]
    assert (row["route"], row["model"], row["status"]) == ("/v1/chat/completions", "tiny-a", 200)
    assert row["completion_tokens"] == reply.json()["usage"]["completion_tokens"] == 4
    assert row["prompt_tokens"] == reply.json()["usage"]["prompt_tokens"]
    assert row["ttft_ms"] > 0
    assert [m["id"] for m in snapshot["models"]["resident"]] == ["tiny-a"]
