"""Discovery and status: /v1, /v1/models, /v1/models/{id}, /health, /stats."""

from __future__ import annotations

from collections.abc import Callable

import httpx
from scripted_engine import ScriptedEngine, scripted_model
from starlette.applications import Starlette

AppFactory = Callable[..., Starlette]
ClientFactory = Callable[[Starlette], httpx.AsyncClient]


async def test_models_lists_the_served_model_with_capabilities_and_gen_defaults(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    model = scripted_model(gen_defaults={"temperature": 0.2, "top_p": 0.9})
    client = client_of(make_app(ScriptedEngine(), model))
    body = (await client.get("/v1/models")).json()
    assert body["object"] == "list"
    [row] = body["data"]
    assert (row["id"], row["object"], row["owned_by"]) == ("scripted-model", "model", "modelhost")
    assert row["context_window"] == 2048
    assert row["capabilities"]["chat_completions"] is True
    assert row["capabilities"]["streaming"] is True
    assert row["gen_defaults"] == {"temperature": 0.2, "top_p": 0.9, "top_k": None}


async def test_retrieving_the_served_model_returns_its_bare_row(client: httpx.AsyncClient) -> None:
    listed = (await client.get("/v1/models")).json()["data"][0]
    response = await client.get("/v1/models/scripted-model")
    assert response.status_code == 200
    assert response.json() == listed


async def test_retrieving_an_unknown_model_is_a_404_model_not_found(
    client: httpx.AsyncClient,
) -> None:
    response = await client.get("/v1/models/org/unknown-model")
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "model_not_found"
    assert "org/unknown-model" in error["message"]


async def test_the_context_length_flag_lowers_the_advertised_window(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    client = client_of(make_app(context_length=100))
    row = (await client.get("/v1/models/scripted-model")).json()
    assert row["context_window"] == 100


async def test_v1_names_the_server_model_and_endpoints(client: httpx.AsyncClient) -> None:
    body = (await client.get("/v1")).json()
    assert body["name"] == "modelhost"
    assert body["model"] == "scripted-model"
    assert "/v1/chat/completions" in body["endpoints"]


async def test_health_says_ok(client: httpx.AsyncClient) -> None:
    assert (await client.get("/health")).json() == {"status": "ok"}


async def test_stats_has_server_prompt_cache_admission_and_batch_blocks(
    client: httpx.AsyncClient,
) -> None:
    body = (await client.get("/stats")).json()
    assert body["server"]["owner"] == "serve"
    assert body["server"]["model"] == "scripted-model"
    assert {"entries", "bytes", "max_bytes"} <= set(body["prompt_cache"])
    assert body["admission"] == {
        "max_safe_context": None,
        "enforced_context_tokens": 2048,
        "memory_budget_bytes": None,
        "usable_bytes": None,
        "weights_bytes": 10_000_000,
    }
    batch = body["batch"]
    assert {"configured", "active_rows", "pending_rows", "kv_bytes", "kv_budget_bytes"} <= set(
        batch
    )
    assert (batch["configured"], batch["active_rows"], batch["pending_rows"]) == (8, 0, 0)


async def test_stats_report_the_memory_budget_and_its_safe_context(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    model = scripted_model(context_length=1 << 20, weights_bytes=1_000_000)
    client = client_of(make_app(ScriptedEngine(), model, memory_budget_gb=0.002))
    admission = (await client.get("/stats")).json()["admission"]
    assert admission["memory_budget_bytes"] == 2_000_000
    assert admission["weights_bytes"] == 1_000_000
    assert 0 < admission["max_safe_context"] == admission["enforced_context_tokens"]
