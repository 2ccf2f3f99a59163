"""Ollama's model routes: `GET /api/version`, `GET /api/tags`, `POST /api/show`, `GET /api/ps`,
`POST /api/embed` and the older `POST /api/embeddings`; and the model-management routes this
server does not offer (push, create, copy, delete), each a 501 that says so (pull is pull.py's).

What a model is and can do comes from its files and its family record (`residency.model_facts`)
without loading it: `capabilities` are `completion` (it generates), `tools` (it has a chat
template: calls are parsed from any template's output), `thinking` (its family marks
reasoning), `vision`, `embedding` (an encoder); never `insert` (no family declares a
fill-in-the-middle format). A model's `digest` is a SHA-256 of its id, size and modification
time: it changes when the file does, as Ollama's does.
"""

from __future__ import annotations

import hashlib
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from modelhost.inference.contracts import InvalidRequest, RequestError
from modelhost.residency.model_facts import ModelFacts, model_facts
from modelhost.server.exchange import answer_json
from modelhost.server.http import RequestLog, serving_stage
from modelhost.server.ollama import wire
from modelhost.server.ollama.generation import NS, check_name
from modelhost.server.openai.embedding_routes import encoder_for, parse_input

if TYPE_CHECKING:
    from modelhost.residency.registry import ModelEntry

# Clients gate features on the version they read here (tool calls, thinking, structured
# outputs); this server speaks the API of Ollama 0.12.
OLLAMA_VERSION = "0.12.0"
OPERATIONS = ("generate", "embed")  # what a model must do to be listed


async def version(request: Request) -> Response:
    return JSONResponse({"version": OLLAMA_VERSION})


# ---------------------------------------------------------------------------------------------
# tags, show, ps


def _entries(request: Request) -> list[ModelEntry] | None:
    """The servable local models (None for a server of one model, without a registry)."""
    router = getattr(request.app.state, "router", None)
    if router is None:
        return None
    return [
        e
        for e in router.registry.entries()
        if e.refusal is None and any(op in e.operations for op in OPERATIONS)
    ]


def parameter_size(count: int | None) -> str:
    if not count:
        return ""
    if count >= 1_000_000_000:
        return f"{count / 1e9:.1f}B"
    return f"{count / 1e6:.0f}M"


def details(entry: ModelEntry, facts: ModelFacts) -> dict[str, Any]:
    family = entry.architecture or ""
    return {
        "parent_model": "",
        "format": entry.format,
        "family": family,
        "families": [family] if family else None,
        "parameter_size": parameter_size(facts.parameter_count),
        "quantization_level": facts.quantization,
    }


def _mtime_ns(entry: ModelEntry) -> int:
    """When the model's file last changed (0 when it went away since the registry's scan)."""
    try:
        return entry.path.stat().st_mtime_ns
    except OSError:
        return 0


def _modified(entry: ModelEntry) -> datetime:
    return datetime.fromtimestamp(_mtime_ns(entry) / NS, UTC)


def digest(entry: ModelEntry) -> str:
    identity = f"{entry.id}:{entry.size_bytes}:{_mtime_ns(entry)}"
    return hashlib.sha256(identity.encode()).hexdigest()


def tag_row(entry: ModelEntry) -> dict[str, Any]:
    name = wire.listed_name(entry.id)
    return {
        "name": name,
        "model": name,
        "modified_at": wire.created_at(_modified(entry)),
        "size": entry.size_bytes,
        "digest": digest(entry),
        "details": details(entry, model_facts(entry)),
    }


async def tags(request: Request) -> Response:
    entries = _entries(request)
    if entries is None:
        card = serving_stage(request).card()
        name = wire.listed_name(card.id)
        row = {
            "name": name,
            "model": name,
            "size": 0,
            "digest": "",
            "details": {"family": card.family},
        }
        return JSONResponse({"models": [row]})
    rows = [tag_row(entry) for entry in entries]
    return JSONResponse({"models": rows + adapter_tag_rows(request, rows)})


def adapter_tag_rows(request: Request, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each LoRA adapter as a model of its own, its base its `parent_model`."""
    bases = {row["model"]: row for row in rows}
    listed = []
    for adapter in request.app.state.router.adapters.entries():
        base = bases.get(wire.listed_name(adapter.base))
        if base is None:
            continue
        name = wire.listed_name(adapter.name)
        details = {**base["details"], "parent_model": wire.listed_name(adapter.base)}
        listed.append({**base, "name": name, "model": name, "details": details})
    return listed


def capabilities(entry: ModelEntry, facts: ModelFacts) -> list[str]:
    found = []
    if "generate" in entry.operations:
        found.append("completion")
        if facts.chat_template:
            found.append("tools")
        if facts.reasoning:
            found.append("thinking")
        if facts.vision:
            found.append("vision")
    if "embed" in entry.operations:
        found.append("embedding")
    return found


def model_info(entry: ModelEntry, facts: ModelFacts, window: int | None = None) -> dict[str, Any]:
    """The header's fields, with `<arch>.context_length` the window served (`window`) where
    known: agents size their history by it, and the file's own may be longer."""
    info = dict(facts.metadata)
    arch = entry.architecture or ""
    info.setdefault("general.architecture", arch)
    if facts.parameter_count is not None:
        info.setdefault("general.parameter_count", facts.parameter_count)
    if window is not None:
        info[f"{arch}.context_length"] = window
    elif facts.context_length is not None:
        info.setdefault(f"{arch}.context_length", facts.context_length)
    if facts.embedding_length is not None:
        info.setdefault(f"{arch}.embedding_length", facts.embedding_length)
    return info


def served_window(request: Request, entry: ModelEntry) -> int | None:
    """The window `entry` answers in: a resident model's enforced one, else the one the
    registry expects it to be served at (its own, or --context-length)."""
    unit = request.app.state.router.host.peek(entry.id)
    stage = getattr(unit, "stage", None)
    if stage is not None and hasattr(stage, "card"):
        window: int = stage.card().context_window
        return window
    row = getattr(unit, "card_row", None) or {}  # a worker: the row it gave when it started
    if isinstance(row.get("context_window"), int):
        return int(row["context_window"])
    return entry.context_length


def _parameters(request: Request, entry: ModelEntry) -> str:
    """The model's sampling defaults, one `name value` a line as a Modelfile writes them
    (known once it is resident)."""
    router = request.app.state.router
    unit = router.host.peek(entry.id)
    stage = getattr(unit, "stage", None)
    defaults: dict[str, Any] = {}
    if stage is not None and hasattr(stage, "card"):
        defaults = dict(stage.card().gen_defaults)
    elif unit is not None:  # a worker: the row it gave when it started
        defaults = dict((getattr(unit, "card_row", None) or {}).get("gen_defaults") or {})
    return "\n".join(
        f"{key} {value:g}" if isinstance(value, float) else f"{key} {value}"
        for key, value in defaults.items()
        if value is not None
    )


async def show(request: Request) -> Response:
    log = RequestLog(wire.new_id(), "POST /api/show")

    async def describe(body: dict[str, Any]) -> dict[str, Any]:
        named = body.get("model", body.get("name"))
        entries = _entries(request)
        if entries is None:
            card = serving_stage(request).card()
            wire.local_id(named, lambda model_id: model_id == card.id)
            found = ["completion", "tools"] + (["thinking"] if card.reasoning else [])
            info: dict[str, Any] = {"general.architecture": card.family}
            info[f"{card.family}.context_length"] = card.context_window
            return {
                "details": {"format": "", "family": card.family, "families": [card.family]},
                "model_info": info,
                "capabilities": found + (["vision"] if card.vision else []),
                "template": "",
                "parameters": "",
                "modelfile": "",
            }
        registry = request.app.state.router.registry
        entry = registry.get(wire.local_id(named, lambda i: registry.get(i) is not None))
        if entry not in entries:  # local, but not a model this server can answer with
            reason = entry.refusal or "it neither generates nor embeds"
            raise InvalidRequest(f"model '{entry.id}' cannot be served: {reason}", "model")
        facts = model_facts(entry)
        return {
            "modelfile": f"# modelhost serves {entry.id}\nFROM {entry.path}\n",
            "parameters": _parameters(request, entry),
            "template": facts.chat_template or "",
            "details": details(entry, facts),
            "model_info": model_info(entry, facts, served_window(request, entry)),
            "capabilities": capabilities(entry, facts),
            "modified_at": wire.created_at(_modified(entry)),
        }

    return await answer_json(request, log, wire.ollama_error, describe)


async def running(request: Request) -> Response:
    """`/api/ps`: the resident models; `expires_at` is when its hold after its last response
    ends (a pinned model's never does); `size_vram` is what sits in GPU memory."""
    router = getattr(request.app.state, "router", None)
    if router is None:
        return JSONResponse({"models": []})
    entries = {entry.id: entry for entry in router.registry.entries()}
    on_gpu = bool(getattr(getattr(router.registry, "shape", None), "cuda", False))
    now = time.time()
    rows = []
    for model in router.host.resident():
        entry = entries.get(model.id)
        if entry is None or model.state == "draining":
            continue
        facts = model_facts(entry)
        if model.pinned:
            expires = wire.PINNED_UNTIL
        else:
            since = now if model.leases else model.last_used_at
            try:
                expires = datetime.fromtimestamp(since + model.hold_s, UTC)
            except (OverflowError, ValueError, OSError):  # a hold beyond the calendar
                expires = wire.PINNED_UNTIL
        name = wire.listed_name(model.id)
        rows.append(
            {
                "name": name,
                "model": name,
                "size": model.bytes,
                "digest": digest(entry),
                "details": details(entry, facts),
                "expires_at": wire.created_at(expires),
                "size_vram": model.bytes if on_gpu else 0,
                "context_length": served_window(request, entry) or facts.context_length,
            }
        )
    return JSONResponse({"models": rows})


# ---------------------------------------------------------------------------------------------
# Embeddings


async def embed(request: Request) -> Response:
    """`/api/embed`: `input` a string or a list of strings; `embeddings`, unit vectors."""
    log = RequestLog(wire.new_id(), "POST /api/embed")

    async def work(body: dict[str, Any]) -> dict[str, Any]:
        started = time.monotonic()
        stage = await encoder_for(request, body.get("model"))
        check_name(request, body.get("model"), stage.model_id)
        wire.keep_alive(body)
        truncate = body.get("truncate")
        if truncate is not None and not isinstance(truncate, bool):
            raise InvalidRequest("truncate must be a boolean", param="truncate")
        dimensions = body.get("dimensions")
        if dimensions is not None and (type(dimensions) is not int or dimensions < 1):
            raise InvalidRequest("dimensions must be a positive integer", param="dimensions")
        raw = body.get("input")
        if not isinstance(raw, str | list):
            raise InvalidRequest("input must be a string or a list of strings", param="input")
        result = await stage.embed(parse_input(raw), dimensions)
        return {
            "model": body.get("model"),
            "embeddings": result.vectors,
            "total_duration": int((time.monotonic() - started) * NS),
            "load_duration": 0,
            "prompt_eval_count": result.prompt_tokens,
        }

    return await answer_json(request, log, wire.ollama_error, work)


async def embeddings(request: Request) -> Response:
    """The older `/api/embeddings`: one `prompt`, one `embedding`."""
    log = RequestLog(wire.new_id(), "POST /api/embeddings")

    async def work(body: dict[str, Any]) -> dict[str, Any]:
        stage = await encoder_for(request, body.get("model"))
        check_name(request, body.get("model"), stage.model_id)
        wire.keep_alive(body)
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise InvalidRequest("prompt must be a non-empty string", param="prompt")
        result = await stage.embed([prompt], None)
        return {"embedding": result.vectors[0]}

    return await answer_json(request, log, wire.ollama_error, work)


# ---------------------------------------------------------------------------------------------
# Not offered

NOT_OFFERED = {
    "/api/push": "pushing models is not offered by this server",
    "/api/create": "creating models is not offered: modelhost serves model files as they are",
    "/api/copy": "copying models is not offered by this server",
    "/api/delete": "deleting models is not offered: remove the file from disk",
}


async def not_offered(request: Request) -> Response:
    message = NOT_OFFERED[request.url.path]
    return wire.ollama_error(501, RequestError(501, message).body)
