"""Routed servers for tests: scripted models of known sizes behind one app, and a live server."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scripted_engine import ScriptedEngine, scripted_model
from starlette.applications import Starlette

from modelhost.inference.stage import InferenceStage
from modelhost.residency.host import ResidencyHost
from modelhost.residency.inprocess import InProcessUnit
from modelhost.residency.registry import ModelEntry
from modelhost.residency.router import ModelRouter
from modelhost.residency.unit import LoadProgress
from modelhost.server.app import create_routed_app
from modelhost.server.settings import ServeSettings

MB = 1_000_000


class ScriptedUnit(InProcessUnit):
    """An in-process unit over a scripted engine; its estimate stands (it never measures)."""

    def measured_bytes(self) -> int | None:
        return None


@dataclass
class FakeRegistry:
    entries_by_id: dict[str, ModelEntry]

    def get(self, model_id: str) -> ModelEntry | None:
        return self.entries_by_id.get(model_id)

    def entries(self) -> list[ModelEntry]:
        return list(self.entries_by_id.values())


@dataclass
class RoutedWorld:
    """Models that answer `[<id>]` one token per `step_s`, a host with `budget_mb`, an app."""

    sizes_mb: dict[str, int]
    budget_mb: int
    current: str = "a"
    step_s: float = 0.0
    failing: set[str] = field(default_factory=set)
    gates: dict[str, Any] = field(default_factory=dict)  # id → asyncio.Event held before load
    engines: dict[str, ScriptedEngine] = field(default_factory=dict)
    loads: list[str] = field(default_factory=list)
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    progress: dict[str, float] = field(default_factory=dict)  # reported before a gate
    refusals: dict[str, str] = field(default_factory=dict)  # entries the registry refuses

    def __post_init__(self) -> None:
        entries = {
            model_id: ModelEntry(
                model_id,
                Path(f"/models/{model_id}"),
                "safetensors",
                "llama",
                size * MB,
                size * MB,
                size * MB,
                refusal=self.refusals.get(model_id),
            )  # fmt: skip
            for model_id, size in self.sizes_mb.items()
        }
        self.registry = FakeRegistry(entries)
        self.host: ResidencyHost[ScriptedUnit] = ResidencyHost(
            budget_bytes=self.budget_mb * MB,
            source=self.registry.get,
            load=self.load,
            publish=lambda name, payload: self.events.append((name, payload)),
        )
        self.router = ModelRouter(self.host, self.registry, self.current)
        self.app: Starlette = create_routed_app(self.router, ServeSettings(heartbeat_s=15.0))

    async def load(self, entry: Any, progress: LoadProgress) -> ScriptedUnit:
        if entry.id in self.progress:
            progress.report(self.progress[entry.id])
        gate = self.gates.get(entry.id)
        if gate is not None:
            await gate.wait()
        self.loads.append(entry.id)
        if entry.id in self.failing:
            raise RuntimeError("weights are corrupt")
        script = ("[", entry.id, "]") if not self.step_s else ("[", entry.id, "]") * 20
        engine = ScriptedEngine(script, step_s=self.step_s)
        self.engines[entry.id] = engine
        return ScriptedUnit(InferenceStage(engine, scripted_model(entry.id)))

    def leases(self) -> dict[str, int]:
        return {m.id: m.leases for m in self.host.resident()}
