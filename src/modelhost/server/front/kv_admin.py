"""`DELETE /api/kv[?model=ID]`: empty the prefix KV store on disk, every model's part or one's;
and the caches' part of `/stats` (the store's size, and each model's packed weights and blocks).

An operator route (server/access.py guards it like load and unload). A resident model keeps the
blocks its memory holds, and writes them back when it unloads: clear after unloading to start
empty. Answers what was removed and what the store holds now.
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from modelhost.residency.disk_caches import model_caches
from modelhost.residency.kv.kv_store import KVDiskStore
from modelhost.server.openai.wire import openai_error


def kv_store(request: Request) -> KVDiskStore:
    return KVDiskStore(budget_bytes=request.app.state.settings.kv_disk_bytes)


async def clear_kv(request: Request) -> Response:
    store = kv_store(request)
    model_id = request.query_params.get("model") or None
    if model_id is not None:
        router = getattr(request.app.state, "router", None)
        known = router is not None and router.registry.get(model_id) is not None
        stored = {m.id for m in (await asyncio.to_thread(store.usage)).models}
        if not known and model_id not in stored:
            body = {
                "message": f"model '{model_id}' is not a local model",
                "code": "model_not_found",
            }
            return openai_error(404, {**body, "type": "invalid_request_error", "param": "model"})
    removed = await asyncio.to_thread(store.clear, model_id)
    usage = await asyncio.to_thread(store.usage)
    return JSONResponse(
        {"object": "kv_store", "removed": removed.as_json(), "store": usage.as_json()}
    )


async def kv_stats(request: Request) -> dict[str, object]:
    """The store's part of `/stats`."""
    return (await asyncio.to_thread(kv_store(request).usage)).as_json()


async def disk_cache_stats(request: Request) -> dict[str, object]:
    """`/stats.disk_caches`: what the packed weights copies and the KV store take on disk, by
    model (residency/disk_caches.py)."""

    def read() -> dict[str, object]:
        rows = model_caches(request.app.state.router.registry.entries())
        return {
            "packed_bytes": sum(row.packed_bytes for row in rows),  # every file is in a row
            "models": [row.as_json() for row in rows if row.packed_bytes or row.kv_bytes],
        }

    return await asyncio.to_thread(read)


KV_ROUTES = (("DELETE", "/api/kv", clear_kv),)
