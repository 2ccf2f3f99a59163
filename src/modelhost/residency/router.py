"""Which model answers a request: the body's `model`, leased from the residency host.

An exact local id (one the registry lists) leases that model, loading it when it is not
resident, and a LoRA adapter's name its base (residency/adapter_catalog.py); anything else
(no `model`, an alias such as `gpt-4`, a non-string) is answered by the
current model. Naming a model never changes the current one. What a request needs its model to
do decides the rest: an `embed` goes to the named encoder, else the current model when it
embeds, else the first local encoder; a `transcribe` to the named transcriber, else the first
local one (clients send `whisper-1`). A local model named for something it cannot do is refused
before anything loads. Reads that name no model go to the *active* unit: the current model when
it is resident, else the most recently used ready one. This module knows ids, leases and units;
which paths need what, and HTTP, are the server's (`server/surfaces.py`, `server/front/leasing.py`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from modelhost.inference.encoder_ids import (
    embedding_model_only_message,
    not_a_reranker_message,
    not_an_embedding_model_message,
    reranker_only_message,
)
from modelhost.residency.adapter_catalog import AdapterCatalog
from modelhost.residency.lease import Lease
from modelhost.residency.registry import ModelEntry
from modelhost.residency.unit import ResidencyError, ResidentModel, Unit


class Registry(Protocol):
    def get(self, model_id: str) -> ModelEntry | None: ...
    def entries(self) -> list[ModelEntry]: ...


class RoutedUnit(Unit, Protocol):
    @property
    def model_id(self) -> str: ...
    def interrupt(self) -> None: ...


U = TypeVar("U", bound=RoutedUnit)


class Host(Protocol[U]):
    """What the router and the server lease from and look at: one machine's `ResidencyHost`, or
    a cluster's `ClusterHost` (a residency host per node, residency/cluster.py)."""

    @property
    def budget_bytes(self) -> int: ...
    async def acquire(
        self, model_id: str, *, need: str | None = None, body: bytes | None = None
    ) -> Lease[U]: ...
    def peek(self, model_id: str) -> U | None: ...
    def peek_on(self, model_id: str, node_name: str) -> U | None: ...
    def resident(self) -> list[ResidentModel]: ...
    def used_bytes(self) -> int: ...
    def pin(self, model_id: str, pinned: bool = True) -> bool: ...
    def unpin(self, model_id: str) -> bool: ...
    def keep_alive(self, model_id: str, seconds: float) -> bool: ...
    async def unload(self, model_id: str, *, force: bool = False) -> bool | None: ...
    def subscribe(self, listener: Callable[[str, dict[str, Any]], None]) -> None: ...
    def nodes_view(self) -> list[dict[str, Any]] | None: ...
    def close(self) -> asyncio.Task[None]: ...


@dataclass(frozen=True, slots=True)
class ListedModel:
    entry: ModelEntry
    unit: Any  # the resident unit, or None
    resident: bool
    current: bool
    state: str = "available"  # or what the host says: loading, ready, draining
    progress: float | None = None  # while loading: the fraction of its weights read
    nodes: tuple[str, ...] = ()  # in a cluster: the nodes that hold it


class ModelRouter(Generic[U]):
    def __init__(
        self,
        host: Host[U],
        registry: Registry,
        current: str,
        adapters: AdapterCatalog | None = None,
    ) -> None:
        self.host = host
        self.registry = registry
        self.current = current
        self.adapters = adapters if adapters is not None else AdapterCatalog()
        self._companions: dict[str, str] = {}

    def route(self, named: str | None, need: str = "generate") -> str:
        """The id that answers a request naming `named` for `need`.

        Raises ResidencyError("wrong-operation") for a local model that cannot do `need`, or
        when no local model can; ("unknown-model") for a reranker named that is not local
        (rerank clients name their model; there is no stand-in to answer for it). A LoRA
        adapter's name is its base's (whose unit runs the adapter's rows)."""
        adapter = self.adapters.get(named)
        if adapter is not None:
            named = adapter.base
        entry = self.registry.get(named) if named is not None else None
        if entry is not None:
            if need not in entry.operations:
                raise ResidencyError("wrong-operation", cannot_message(entry, need))
            if entry.refusal is not None:
                message = f"model '{entry.id}' cannot be served: {entry.refusal}"
                raise ResidencyError("unsupported-model", message)
            return entry.id
        if need == "generate":
            return self.current
        if need == "rerank" and named is not None:
            raise ResidencyError("unknown-model", f"The model '{named}' does not exist")
        current = self.registry.get(self.current)
        if current is not None and need in current.operations:
            return current.id
        default = self._companion(need)
        if default is None:
            fallback = current if need == "embed" else None  # the reference names the served one
            raise ResidencyError("wrong-operation", cannot_message(fallback, need))
        return default

    def _companion(self, need: str) -> str | None:
        """The first local model that does `need` (remembered; the disk is scanned once)."""
        known = self._companions.get(need)
        if known is not None and self.registry.get(known) is not None:
            return known
        found = next((e.id for e in self.registry.entries() if need in e.operations), None)
        if found is not None:
            self._companions[need] = found
        return found

    async def acquire(self, model_id: str, *, body: bytes | None = None) -> Lease[U]:
        """A lease on `model_id`; `body`, the request's, lets a cluster keep a conversation on
        the replica that has its prefix."""
        return await self.host.acquire(model_id, body=body)

    def active(self) -> U | None:
        """The unit that answers reads naming no model, without loading anything."""
        unit = self.host.peek(self.current)
        if unit is not None:
            return unit
        ready = [
            m for m in self.host.resident() if m.state == "ready" and "generate" in m.operations
        ]
        if not ready:
            return None
        latest = max(ready, key=lambda m: m.last_used_at)
        return self.host.peek(latest.id)

    async def serve(self, model_id: str) -> None:
        """Make `model_id` current (loading it now, so the switch is ready when it returns)."""
        if self.registry.get(model_id) is None:
            raise ResidencyError("does-not-fit", f"model '{model_id}' is not a local model")
        async with await self.host.acquire(model_id):
            self.current = model_id

    def listing(self) -> list[ListedModel]:
        """Every local model: the current one first, then the other resident ones, then the rest."""
        resident = self.host.resident()
        held = {m.id: m for m in resident}
        rows = []
        for entry in self.registry.entries():
            model = held.get(entry.id)
            state = model.state if model is not None else "available"
            progress = model.progress if model is not None else None
            unit, current = self.host.peek(entry.id), entry.id == self.current
            nodes = tuple(m.node for m in resident if m.id == entry.id and m.node is not None)
            rows.append(ListedModel(entry, unit, state == "ready", current, state, progress, nodes))
        return sorted(rows, key=lambda row: (not row.current, not row.resident))

    def residency(self) -> dict[str, Any]:
        """`/stats.models`: the current model, the budget and what is resident."""
        models = self.host.resident()
        nodes = self.host.nodes_view()  # a cluster's members
        return {
            **({"nodes": nodes} if nodes is not None else {}),
            "current": self.current,
            "budget_bytes": self.host.budget_bytes,
            "resident_bytes": sum(m.bytes for m in models),
            "resident": [
                {
                    "id": m.id,
                    "state": m.state,
                    "bytes": m.bytes,
                    "pinned": m.pinned,
                    "leases": m.leases,
                    "last_used_at": m.last_used_at,
                    **({"progress": round(m.progress, 4)} if m.progress is not None else {}),
                    **({"node": m.node} if m.node is not None else {}),
                }
                for m in models
            ],
        }

    def interrupt_all(self) -> None:
        """End every request on every resident unit now (a forced shutdown; any thread)."""
        for model_id in [m.id for m in self.host.resident()]:
            unit = self.host.peek(model_id)
            if unit is not None:
                unit.interrupt()

    async def close(self) -> None:
        await self.host.close()


def cannot_message(entry: ModelEntry | None, need: str) -> str:
    """The reference's refusal of a model asked for what it does not do."""
    name = entry.id if entry is not None else "the current model"
    if need == "embed":
        return not_an_embedding_model_message(name)
    if need == "rerank" and entry is None:
        return (
            "no reranker is installed: serve a cross-encoder (BERT or XLM-R, folder or GGUF) "
            "or a Qwen3-Reranker"
        )
    if need == "rerank":
        return not_a_reranker_message(name)
    if entry is not None and "rerank" in entry.operations:
        return reranker_only_message(name)
    if need == "transcribe" and entry is None:
        return "no transcription model is installed: no local Whisper (faster-whisper) model"
    if need == "transcribe":
        return f'model "{name}" is not a transcription model'
    return embedding_model_only_message(name)
