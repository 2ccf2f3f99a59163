"""Discovery and status: `GET /v1`, `/v1/models`, `/v1/models/{id}`, `/health`, `/stats`.

Every model row says the window a prompt and its answer share, where each client reads it:
`context_length` and `max_model_len` (vLLM's name), Anthropic's `max_input_tokens` and
`max_tokens`. A listing asked for with an `anthropic-version` header (Anthropic's SDKs send
one) is in Anthropic's shape: rows of `type`, `id`, `display_name`, `created_at`, `lifecycle`
and the two windows, in a list with `has_more`, `first_id` and `last_id`.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from modelhost import __version__
from modelhost.inference.contracts import ModelCard, StageStats
from modelhost.residency.router import ListedModel
from modelhost.server.front.kv_admin import disk_cache_stats, kv_stats
from modelhost.server.http import serving_stage
from modelhost.server.openai.wire import openai_error

DISCOVERY_ENDPOINTS = ("/v1/models", "/health", "/stats")  # listed after the routed paths
GEN_DEFAULT_KEYS = ("temperature", "top_p", "top_k")


def model_row(card: ModelCard) -> dict[str, Any]:
    """One `/v1/models` row: OpenAI's fields, then what this server can do with the model."""
    return {
        "id": card.id,
        "object": "model",
        "created": card.created,
        "owned_by": "modelhost",
        "context_window": card.context_window,
        **window_fields(card.context_window),
        "reasoning": card.reasoning,
        "vision": card.vision,
        "audio": False,
        "batch_mode": "batch",
        "tools": card.tools,
        "structured_output": True,
        "embeddings": False,
        "capabilities": {
            "chat_completions": card.chat,
            "text_completions": True,
            "anthropic_messages": card.chat,
            "responses": card.chat,
            "streaming": True,
            "tools": card.tools,
            "structured_output": True,
            "logprobs": True,
            "embeddings": False,
            "vision": card.vision,
            "audio": False,
            "adapters": card.adapters,
            "training": False,
            "transcription": False,
        },
        "gen_defaults": {key: card.gen_defaults.get(key) for key in GEN_DEFAULT_KEYS},
    }


def window_fields(window: int | None) -> dict[str, Any]:
    """A model's window under each client's name. A prompt leaves its answer at least one
    token, so the longest prompt, and the longest answer, is one token short of it."""
    if window is None:
        return {}
    most = max(window - 1, 0)
    return {
        "context_length": window,
        "max_model_len": window,
        "max_input_tokens": most,
        "max_tokens": most,
    }


async def list_models(request: Request) -> Response:
    rows = all_rows(request)
    if "anthropic-version" in request.headers:
        return JSONResponse(anthropic_listing(rows))
    return JSONResponse({"object": "list", "data": rows})


def anthropic_listing(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The rows as Anthropic's `GET /v1/models` lists them (one page: every model), in its
    fields only: its SDK reads `capabilities` as an object of its own shape."""
    data = [
        {
            "type": "model",
            "id": row["id"],
            "display_name": row["id"],
            "created_at": datetime.fromtimestamp(row.get("created") or 0, UTC).isoformat(),
            "lifecycle": "active",
            **{key: row[key] for key in ("max_input_tokens", "max_tokens") if key in row},
        }
        for row in rows
    ]
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    return {"data": data, "has_more": False, "first_id": first, "last_id": last}


async def retrieve_model(request: Request) -> Response:
    model_id = request.path_params["model_id"]
    rows = [row for row in all_rows(request) if row["id"] == model_id]
    if not rows:
        message = f"The model '{model_id}' does not exist"
        body = {"message": message, "type": "invalid_request_error", "code": "model_not_found"}
        return openai_error(404, {**body, "param": "model"})
    if "anthropic-version" in request.headers:
        return JSONResponse(anthropic_listing(rows)["data"][0])
    return JSONResponse(rows[0])


def all_rows(request: Request) -> list[dict[str, Any]]:
    """Every model's row, then each LoRA adapter's."""
    router = getattr(request.app.state, "router", None)
    if router is not None:
        rows = listed_rows(router.listing())
        adapters = [(e.name, e.base, e.path) for e in router.adapters.entries()]
    else:
        stage = serving_stage(request)
        rows = [served_row(stage)]
        held = getattr(stage, "adapters", None)  # a generative model's adapters
        adapters = []
        if held is not None:
            adapters = [(name, stage.model_id, held.path(name)) for name in held.names()]
    return rows + adapter_rows(rows, adapters)


def adapter_rows(
    rows: list[dict[str, Any]], adapters: list[tuple[str, str, str | None]]
) -> list[dict[str, Any]]:
    """A LoRA adapter's row: its base's, under its own id, with vLLM's `parent` (the base)
    and `root` (the adapter's files)."""
    bases = {row["id"]: row for row in rows}
    listed = []
    for name, base, path in adapters:
        row = {**bases.get(base, {"object": "model", "owned_by": "modelhost"}), "id": name}
        row.pop("current", None)
        listed.append({**row, "parent": base, "root": path, "adapter": True})
    return listed


def served_row(stage: Any) -> dict[str, Any]:
    """The row of the one model this app serves (a worker's, or `build_app`'s)."""
    if hasattr(stage, "card"):
        return model_row(stage.card())
    if hasattr(stage, "transcribe"):
        return companion_row(stage.model_id, ("transcribe",))
    return companion_row(stage.model_id, ("rerank",) if hasattr(stage, "rerank") else ("embed",))


def listed_rows(listing: list[ListedModel]) -> list[dict[str, Any]]:
    """The router's listing as rows, transcription companions last; the current model's row says
    whether this server transcribes."""
    rows = [listed_row(m) for m in listing]
    rows.sort(key=lambda row: bool(row.get("transcription")))
    if any(row.get("transcription") for row in rows):
        for row in rows:
            if row["current"] and "capabilities" in row:
                row["capabilities"] = {**row["capabilities"], "transcription": True}
    return rows


def listed_row(listed: ListedModel) -> dict[str, Any]:
    """A resident model answers for itself; the others are listed as the registry knows them."""
    entry = listed.entry
    if "generate" not in entry.operations:
        row = companion_row(entry.id, entry.operations)
    elif listed.unit is not None:
        row = {**resident_row(listed.unit), "id": entry.id}
    else:  # not resident: the window the registry knows it would be served at
        row = {"id": entry.id, "object": "model", "created": 0, "owned_by": "modelhost"}
        row.update(window_fields(entry.context_length))
    extra: dict[str, Any] = {}
    if listed.progress is not None:
        extra["progress"] = round(listed.progress, 4)
    if entry.refusal is not None:
        extra["refusal"] = entry.refusal
    if listed.nodes:  # a cluster's: where it is resident
        extra["nodes"] = list(listed.nodes)
    return {
        **row,
        "resident": listed.resident,
        "current": listed.current,
        "state": listed.state,
        **extra,
        "format": entry.format,
        "architecture": entry.architecture,
        "size_bytes": entry.size_bytes,
        "estimate_bytes": entry.estimate_bytes,
    }


def resident_row(unit: Any) -> dict[str, Any]:
    """An in-process unit's row from its stage; a worker's is the row it gave when it started."""
    stage = getattr(unit, "stage", None)
    if stage is not None:
        return model_row(stage.card())
    return dict(getattr(unit, "card_row", None) or {"object": "model", "owned_by": "modelhost"})


def companion_row(model_id: str, operations: tuple[str, ...]) -> dict[str, Any]:
    """An encoder's, a reranker's or a transcriber's row: what it does, and that it does not
    chat."""
    embeds, transcribes = "embed" in operations, "transcribe" in operations
    reranks = "rerank" in operations
    capabilities: dict[str, bool] = {"chat_completions": False}
    if embeds:
        capabilities["embeddings"] = True
    if reranks:
        capabilities["rerank"] = True
    if transcribes:
        capabilities.update(transcription=True, translation=True)
    row: dict[str, Any] = {"id": model_id, "object": "model", "created": 0, "owned_by": "modelhost"}
    if embeds:
        row["embeddings"] = True
    if reranks:
        row["rerank"] = True
    if transcribes:
        row["transcription"] = True
    return {**row, "capabilities": capabilities}


async def index(request: Request) -> Response:
    router = getattr(request.app.state, "router", None)
    model = router.current if router is not None else serving_stage(request).model_id
    return JSONResponse(
        {
            "name": "modelhost",
            "version": __version__,
            "model": model,
            "endpoints": [*request.app.state.surfaces.routed_paths(), *DISCOVERY_ENDPOINTS],
        }
    )


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


def stats_json(stats: StageStats, owner: str) -> dict[str, Any]:
    admission, batch, cache = stats.admission, stats.batch, stats.prompt_cache
    return {
        "server": {"owner": owner, "model": stats.model_id, "started_at": stats.started_at},
        "prompt_cache": {
            "entries": cache.cached_blocks,
            "bytes": cache.cached_bytes,
            "max_bytes": cache.max_bytes,
            "query_tokens": cache.query_tokens,
            "hit_tokens": cache.hit_tokens,
        },
        "admission": {
            "max_safe_context": admission.max_safe_context,
            "enforced_context_tokens": admission.enforced_context_tokens,
            "memory_budget_bytes": admission.memory_budget_bytes,
            "usable_bytes": admission.usable_bytes,
            "weights_bytes": admission.weights_bytes,
        },
        "speculation": {
            "mode": stats.speculation.mode,
            "draft_tokens": stats.speculation.draft_tokens,
            "accepted_tokens": stats.speculation.accepted_tokens,
            "verify_steps": stats.speculation.verify_steps,
            "acceptance_rate": stats.speculation.acceptance_rate,
            "draft_model": stats.speculation.draft_model,
            "draft_model_tokens": stats.speculation.model_draft_tokens,
            "draft_model_accepted_tokens": stats.speculation.model_accepted_tokens,
            "draft_model_forwards": stats.speculation.draft_forwards,
        },
        "batch": {
            "configured": batch.configured,
            "mode": "batch",
            "batched": True,
            "max_queue": batch.max_queue,
            "active_rows": batch.active_rows,
            "pending_rows": batch.pending_rows,
            "submitted_rows": batch.submitted_rows,
            "kv_bytes": batch.kv_bytes,
            "kv_budget_bytes": batch.kv_budget_bytes,
            "prompt_activations": batch.prompt_activations,
        },
    }


async def stats(request: Request) -> Response:
    owner: str = request.app.state.settings.owner
    router = getattr(request.app.state, "router", None)
    unit = router.active() if router is not None else None
    if router is not None and unit is None:
        body: dict[str, Any] = {
            "server": {"owner": owner, "model": router.current, "started_at": None},
            "unavailable": "no model is resident",
        }
    elif unit is not None and not hasattr(unit, "stage"):  # a worker process serves it
        fetched = await unit.get_json("/stats")
        body = fetched if fetched is not None else {"unavailable": "the worker did not answer"}
        body.pop("response_store", None)
        body.setdefault("server", {})["owner"] = owner
        body["worker"] = {"pid": unit.pid, "restarts": unit.worker.restarts}
    else:
        stage = unit.stage if unit is not None else serving_stage(request)
        body = stats_json(stage.stats(), owner)
    store = request.app.state.response_store.stats()
    body["response_store"] = {
        "entries": store.entries,
        "bytes": store.num_bytes,
        "max_bytes": store.max_bytes,
        "ttl_s": store.ttl_s,
    }
    if router is not None:
        body["models"] = router.residency()
        body["kv_store"] = await kv_stats(request)  # the prefix KV store on disk
        body["disk_caches"] = await disk_cache_stats(request)
    return JSONResponse(body)
