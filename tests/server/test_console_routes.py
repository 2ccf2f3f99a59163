"""The console's routes over HTTP: `/` for browsers and JSON clients, the page's files and their
Content-Security-Policy, `--no-console`, the API key, operator actions and the live stream."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
from scripted_engine import ScriptedEngine

from modelhost.server.observability.console import CONSOLE_DIR

HTML = {"accept": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


async def test_the_root_answers_json_to_a_json_client_and_the_page_to_a_browser(client):
    as_json = await client.get("/", headers={"accept": "application/json"})
    assert as_json.json()["name"] == "modelhost"
    assert (await client.get("/")).json()["name"] == "modelhost"  # httpx says */*
    page = await client.get("/", headers=HTML)
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert "<title>modelhost console</title>" in page.text


async def test_the_page_allows_only_the_servers_own_scripts(client):
    page = await client.get("/", headers=HTML)
    policy = page.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "unsafe-inline" not in policy
    assert "unsafe-eval" not in policy and "frame-ancestors 'none'" in policy
    assert page.headers["x-content-type-options"] == "nosniff"
    scripts = re.findall(r"<script\b[^>]*>(.*?)</script>", page.text, re.S)
    assert scripts == [""]  # one module, loaded from its file, nothing inline
    assert not re.search(r"\son[a-z]+=", page.text)  # no inline event handlers either


async def test_every_file_the_page_and_its_modules_name_is_served_with_its_type(client):
    page = (await client.get("/", headers=HTML)).text
    names = set(re.findall(r'"/console/([\w.-]+)"', page))
    for module in CONSOLE_DIR.glob("*.js"):
        names |= set(re.findall(r'from "\./([\w.-]+)"', module.read_text()))
    assert {"app.js", "console.css", "api.js", "dom.js"} <= names
    types = {".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml"}
    for name in names:
        answer = await client.get(f"/console/{name}")
        assert answer.status_code == 200, name
        assert answer.headers["content-type"].startswith(types[Path(name).suffix]), name


async def test_nothing_outside_the_console_folder_is_served(client):
    for path in ("/console/../__init__.py", "/console/%2e%2e/__init__.py", "/console/nope.js"):
        answer = await client.get(path)
        assert answer.status_code == 404, path
        assert "error" in answer.json()


async def test_without_the_console_the_root_answers_json_to_browsers_too(make_app, client_of):
    client = client_of(make_app(console=False))
    assert (await client.get("/", headers=HTML)).json()["name"] == "modelhost"
    assert (await client.get("/console/app.js")).status_code == 404
    assert (await client.get("/api/live")).status_code == 404


async def test_with_an_api_key_the_page_loads_without_it_and_no_data_does(make_app, client_of):
    client = client_of(make_app(api_key="sekret"))
    assert (await client.get("/", headers=HTML)).status_code == 200
    assert (await client.get("/console/app.js")).status_code == 200
    for path in ("/", "/v1", "/v1/models", "/stats", "/api/live", "/api/jobs"):
        assert (await client.get(path)).status_code == 401, path
    key = {"authorization": "Bearer sekret"}
    assert (await client.get("/", headers=key)).json()["name"] == "modelhost"


async def test_a_cors_origin_reaches_the_api_but_not_operator_actions(make_app, client_of):
    origin = "http://localhost:3000"
    client = client_of(make_app(cors_origins=(origin,)))
    headers = {"origin": origin, "sec-fetch-site": "cross-site"}
    assert (await client.get("/v1/models", headers=headers)).status_code == 200
    refused = await client.post("/api/jobs", json={"kind": "bench-serve"}, headers=headers)
    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "cross_origin"
    same = {"origin": "http://testserver", "sec-fetch-site": "same-origin"}
    submitted = await client.post("/api/jobs", json={"kind": "nope"}, headers=same)
    assert submitted.status_code == 400  # past the guard: the job host names what is wrong


def test_the_live_stream_shows_a_request_in_flight_then_its_tokens(make_app, live_server):
    engine = ScriptedEngine(["a", "b", "c", "d"], step_s=0.4)
    server = live_server(make_app(engine))
    seen: list[dict] = []
    with (
        httpx.Client(base_url=server.base_url, timeout=30) as client,
        client.stream("GET", "/api/live") as live,
    ):
        assert live.headers["content-type"].startswith("text/event-stream")
        lines = live.iter_lines()
        posted = False
        for line in lines:
            if not line.startswith("data: "):
                continue
            rows = json.loads(line[6:])["requests"]
            if not posted:
                assert rows == []  # nothing has been asked yet
                with httpx.Client(base_url=server.base_url, timeout=30) as other:
                    other.post("/v1/chat/completions", json={**CHAT, "stream": True}).close()
                posted = True
                continue
            seen.extend(rows)
            if rows and not rows[0]["in_flight"]:
                break
    streaming = [row for row in seen if row["in_flight"]]
    assert streaming and streaming[0]["route"] == "/v1/chat/completions"
    done = seen[-1]
    assert done["status"] == 200 and done["model"] == "scripted-model"
    assert done["completion_tokens"] == 4 and done["prompt_tokens"] > 0
    assert done["ttft_ms"] > 0 and done["tok_s"] > 0


def test_a_shutdown_ends_the_live_stream_cleanly_instead_of_waiting_on_it(make_app, live_server):
    server = live_server(make_app(), shutdown_timeout_s=30)
    with (
        httpx.Client(base_url=server.base_url, timeout=30) as client,
        client.stream("GET", "/api/live") as live,
    ):
        lines = live.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        server.stop()  # a stream still open at the deadline would be cut: an incomplete body
        assert not any(lines)  # no more events, and a complete end
    assert not server.thread.is_alive()
