"""The local access guard: Host, Origin and Sec-Fetch-Site refusals, and who passes."""

from __future__ import annotations

from typing import Any

import pytest
from reliability_support import HELLO, AppFactory, ClientFactory

from modelhost.server.edge.access import access_problem, host_allowed


async def post(make_app: AppFactory, client_of: ClientFactory, headers: dict[str, str],
               **settings: Any) -> Any:  # fmt: skip
    client = client_of(make_app(**settings))
    return await client.post("/v1/chat/completions", json=HELLO, headers=headers)


async def test_a_foreign_host_header_is_refused_as_invalid_host(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    response = await post(make_app, client_of, {"host": "evil.com"})
    assert response.status_code == 403
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("forbidden", "invalid_host")
    assert set(error) == {"message", "type", "code"}


async def test_a_cross_origin_page_is_refused_as_cross_origin(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    response = await post(make_app, client_of, {"origin": "https://evil.com"})
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "cross_origin"


async def test_a_cross_site_fetch_is_refused_as_cross_site(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    response = await post(make_app, client_of, {"sec-fetch-site": "cross-site"})
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "cross_site"


async def test_a_client_that_sends_none_of_those_headers_passes(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    response = await post(make_app, client_of, {})
    assert response.status_code == 200


async def test_a_same_origin_browser_request_passes(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    headers = {"origin": "http://testserver", "sec-fetch-site": "same-origin"}
    response = await post(make_app, client_of, headers)
    assert response.status_code == 200


async def test_a_configured_cors_origin_passes_the_guard_and_gets_cors_headers(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    origin = "http://localhost:3000"
    headers = {"origin": origin, "sec-fetch-site": "cross-site"}
    response = await post(make_app, client_of, headers, cors_origins=(origin,))
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == origin


async def test_a_cors_preflight_from_a_configured_origin_is_answered(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    origin = "http://localhost:3000"
    client = client_of(make_app(cors_origins=(origin,), api_key="k"))
    headers = {
        "origin": origin,
        "sec-fetch-site": "cross-site",
        "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type",
    }
    response = await client.options("/v1/chat/completions", headers=headers)
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == origin


async def test_refusals_at_the_guard_never_reach_the_engine(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    from scripted_engine import ScriptedEngine

    engine = ScriptedEngine()
    client = client_of(make_app(engine))
    await client.post("/v1/chat/completions", json=HELLO, headers={"host": "evil.com"})
    assert engine.submissions == []


async def test_a_worker_app_skips_the_guard_and_the_api_key(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    response = await post(make_app, client_of, {"host": "evil.com"}, owner="worker", api_key="k")
    assert response.status_code == 200


@pytest.mark.parametrize(
    "host",
    ["localhost", "localhost:8080", "127.0.0.1:8080", "127.8.9.1", "[::1]:8080", "app.localhost",
     "host.docker.internal"],
)  # fmt: skip
def test_loopback_names_and_addresses_are_allowed_hosts(host: str) -> None:
    assert host_allowed(host, ["127.0.0.1"], wildcard=False)


def test_a_wildcard_bind_also_allows_ip_literals_but_not_foreign_names() -> None:
    assert host_allowed("192.168.1.20:8080", ["0.0.0.0"], wildcard=True)
    assert not host_allowed("192.168.1.20:8080", ["127.0.0.1"], wildcard=False)
    assert not host_allowed("evil.com", ["0.0.0.0"], wildcard=True)


def test_the_checks_run_host_first_then_origin_then_sec_fetch_site() -> None:
    headers = {"host": "evil.com", "origin": "https://evil.com", "sec-fetch-site": "cross-site"}
    problem = access_problem(headers, bound=["127.0.0.1"], wildcard=False)
    assert problem is not None and problem[0] == "invalid_host"
    headers["host"] = "127.0.0.1:8080"
    problem = access_problem(headers, bound=["127.0.0.1"], wildcard=False)
    assert problem is not None and problem[0] == "cross_origin"
    headers["origin"] = "http://127.0.0.1:8080"
    problem = access_problem(headers, bound=["127.0.0.1"], wildcard=False)
    assert problem is not None and problem[0] == "cross_site"
