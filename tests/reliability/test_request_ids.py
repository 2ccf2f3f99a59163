"""Request ids: every response carries `x-request-id`, the request's one log line carries the
same id, and `--log-format json` writes that line as a JSON object."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest
from reliability_support import HELLO, AppFactory, ClientFactory

from modelhost.residency.host import ResidencyHost
from modelhost.residency.registry import ModelEntry
from modelhost.residency.router import ModelRouter
from modelhost.residency.unit import LoadProgress
from modelhost.residency.workers.supervisor import WorkerProcess
from modelhost.residency.workers.worker_unit import WorkerUnit
from modelhost.server.app import create_routed_app
from modelhost.server.edge.json_logs import JsonLogFormatter, use_json_logs
from modelhost.server.settings import ServeSettings

CHAT = "/v1/chat/completions"


def server_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "modelhost.server"]


async def test_a_json_answer_carries_a_generated_request_id(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    response = await client_of(make_app()).post(CHAT, json=HELLO)
    assert len(response.headers["x-request-id"]) == 32


async def test_a_stream_carries_the_request_id_too(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    response = await client_of(make_app()).post(CHAT, json={**HELLO, "stream": True})
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["x-request-id"]


@pytest.mark.parametrize(
    ("method", "path", "body", "status"),
    [
        ("POST", CHAT, {}, 400),
        ("GET", "/nowhere", None, 404),
        ("POST", "/v1/messages", {"model": "m"}, 400),
    ],
)
async def test_errors_carry_the_request_id(
    make_app: AppFactory,
    client_of: ClientFactory,
    method: str,
    path: str,
    body: dict[str, object] | None,
    status: int,
) -> None:
    response = await client_of(make_app()).request(method, path, json=body)
    assert response.status_code == status
    assert response.headers["x-request-id"]


async def test_refusals_at_the_edge_carry_the_request_id(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    client = client_of(make_app(api_key="k", max_body_bytes=20))
    forbidden = await client.post(CHAT, json=HELLO, headers={"host": "evil.com"})
    unauthorised = await client.post(CHAT, json=HELLO)
    too_large = await client.post(CHAT, json=HELLO, headers={"x-api-key": "k"})
    assert [r.status_code for r in (forbidden, unauthorised, too_large)] == [403, 401, 413]
    assert all(r.headers["x-request-id"] for r in (forbidden, unauthorised, too_large))


async def test_a_sane_client_request_id_is_kept(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    client = client_of(make_app())
    response = await client.post(CHAT, json=HELLO, headers={"x-request-id": "trace-42.a:b"})
    assert response.headers["x-request-id"] == "trace-42.a:b"


@pytest.mark.parametrize("bad", ["has spaces", "x" * 200, "new\\nline", "<script>"])
async def test_an_insane_client_request_id_is_replaced(
    make_app: AppFactory, client_of: ClientFactory, bad: str
) -> None:
    client = client_of(make_app())
    response = await client.post(CHAT, json=HELLO, headers={"x-request-id": bad})
    assert response.headers["x-request-id"] != bad
    assert len(response.headers["x-request-id"]) == 32


async def test_the_request_log_line_carries_the_response_request_id(
    make_app: AppFactory, client_of: ClientFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="modelhost.server")
    response = await client_of(make_app()).post(CHAT, json=HELLO)
    [line] = server_lines(caplog)
    request_id = response.headers["x-request-id"]
    assert line.getMessage().startswith(f"{response.json()['id']} POST {CHAT} 200 ")
    assert line.getMessage().endswith(f" request_id={request_id}")


async def test_a_request_without_a_protocol_handler_gets_one_line_from_the_edge(
    make_app: AppFactory, client_of: ClientFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="modelhost.server")
    response = await client_of(make_app()).get("/v1/models")
    [line] = server_lines(caplog)
    assert " GET /v1/models 200 " in line.getMessage()
    assert line.getMessage().endswith(f"request_id={response.headers['x-request-id']}")


async def test_health_probes_log_at_debug_only(
    make_app: AppFactory, client_of: ClientFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="modelhost.server")
    await client_of(make_app()).get("/health")
    assert server_lines(caplog) == []


async def test_the_json_log_line_has_the_request_fields(
    make_app: AppFactory, client_of: ClientFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="modelhost.server")
    response = await client_of(make_app()).post(CHAT, json=HELLO)
    [record] = server_lines(caplog)
    line = json.loads(JsonLogFormatter().format(record))
    usage = response.json()["usage"]
    assert line["request_id"] == response.headers["x-request-id"]
    assert line["id"] == response.json()["id"]
    assert (line["method"], line["path"], line["status"]) == ("POST", CHAT, 200)
    assert line["prompt_tokens"] == usage["prompt_tokens"]
    assert line["completion_tokens"] == usage["completion_tokens"]
    assert line["ttft_ms"] is not None and line["total_ms"] >= line["ttft_ms"]
    assert (line["level"], line["logger"]) == ("info", "modelhost.server")


def test_other_log_lines_become_json_with_their_message() -> None:
    record = logging.LogRecord("modelhost.x", logging.WARNING, __file__, 1, "hi %s", ("you",), None)
    assert json.loads(JsonLogFormatter().format(record))["message"] == "hi you"


def test_log_format_json_sets_the_json_formatter_on_the_root_handlers(
    make_app: AppFactory,
) -> None:
    root = logging.getLogger()
    handler = logging.StreamHandler()
    root.addHandler(handler)
    saved = {h: h.formatter for h in root.handlers}
    try:
        make_app(log_format="json")
        assert isinstance(handler.formatter, JsonLogFormatter)
        use_json_logs()  # idempotent
        assert isinstance(handler.formatter, JsonLogFormatter)
    finally:
        for each, formatter in saved.items():
            each.setFormatter(formatter)
        root.removeHandler(handler)


async def test_a_request_proxied_to_a_worker_carries_the_same_id_to_it(
    tmp_path: Path, client_of: ClientFactory
) -> None:
    seen: list[httpx.Headers] = []

    async def worker_answers(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers)
        headers = {"content-type": "application/json", "x-request-id": "the-workers-own"}
        return httpx.Response(200, headers=headers, stream=httpx.ByteStream(b'{"ok":true}'))

    class LiveWorker(WorkerProcess):
        async def ensure_alive(self) -> bool:
            return True

    class ProxyUnit(WorkerUnit):
        def __init__(self) -> None:
            super().__init__("w", 1, LiveWorker([]))

        def client(self) -> httpx.AsyncClient:
            transport = httpx.MockTransport(worker_answers)
            return httpx.AsyncClient(transport=transport, base_url="http://worker")

    entry = ModelEntry("w", tmp_path / "w", "safetensors", "llama", 1, 1, 1)

    async def load(_: Any, progress: LoadProgress) -> ProxyUnit:
        return ProxyUnit()

    host: ResidencyHost[Any] = ResidencyHost(budget_bytes=10, source={"w": entry}.get, load=load)

    class Registry:
        def get(self, model_id: str) -> ModelEntry | None:
            return entry if model_id == "w" else None

        def entries(self) -> list[ModelEntry]:
            return [entry]

    app = create_routed_app(ModelRouter(host, Registry(), "w"), ServeSettings())
    response = await client_of(app).post(CHAT, json={**HELLO, "model": "w"})
    request_id = response.headers["x-request-id"]
    assert response.headers.get_list("x-request-id") == [request_id]
    assert seen[0]["x-request-id"] == request_id
    await host.close()
