"""A small world for the residency host: fake models of known sizes and units that log."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from modelhost.residency.host import ResidencyHost
from modelhost.residency.unit import LoadProgress

GB = 1_000_000_000


@dataclass(frozen=True)
class FakeEntry:
    id: str
    estimate_bytes: int
    weights_bytes: int
    operations: tuple[str, ...] = ("generate",)
    work_bytes: int = 0
    kv_row_bytes: int = 0
    kv_pool_bytes: int = 0
    store_queue_bytes: int = 0


@dataclass
class FakeUnit:
    model_id: str
    log: list[str]
    resumed: bool = False
    measured: int | None = None
    reading: int | None = None  # what a refresh() finds, when the unit did not push it
    flushed: bool = True
    is_broken: bool = False
    paused: bool = False
    drain_gate: asyncio.Event | None = None
    kept_bytes: int = 0  # held only for the next request (a KV pool): given back when asked
    given_back: int = 0  # how many times it was asked

    def measured_bytes(self) -> int | None:
        return self.measured

    async def refresh(self) -> None:
        if self.reading is not None:
            self.measured = self.reading

    async def give_back_idle_memory(self) -> None:
        self.given_back += 1
        for reading in ("measured", "reading"):
            if getattr(self, reading) is not None:
                setattr(self, reading, getattr(self, reading) - self.kept_bytes)
        self.kept_bytes = 0

    def broken(self) -> bool:
        return self.is_broken

    def pause(self) -> None:
        self.paused = True
        self.log.append(f"pause {self.model_id}")

    def resume(self) -> None:
        self.paused = False
        self.log.append(f"resume {self.model_id}")

    async def close(self) -> bool:
        self.log.append(f"drain {self.model_id}")
        if self.drain_gate is not None:
            await self.drain_gate.wait()
        self.log.append(f"flush {self.model_id}")
        self.log.append(f"release {self.model_id}")
        return self.flushed


@dataclass
class World:
    """Entries by id, a loader that logs and can be held or failed, and the host's events."""

    sizes_gb: dict[str, float]
    log: list[str] = field(default_factory=list)
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    units: dict[str, FakeUnit] = field(default_factory=dict)
    gates: dict[str, asyncio.Event] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)
    saved: set[str] = field(default_factory=set)  # models whose saved state a load finds
    operations: dict[str, tuple[str, ...]] = field(default_factory=dict)
    weights_gb: dict[str, float] = field(default_factory=dict)  # default: the whole estimate
    # What a lease may claim beyond the estimate, in GB: (a full context of KV, the pool's
    # ceiling); default nothing (a preallocated pool).
    claims_gb: dict[str, tuple[float, float]] = field(default_factory=dict)
    now: float = 0.0
    num_loads: int = 0
    progress_steps: dict[str, list[float]] = field(default_factory=dict)  # reported before a gate
    unreachable: bool = False  # every load fails as a dead cluster node's does

    def entry(self, model_id: str) -> FakeEntry | None:
        if model_id not in self.sizes_gb:
            return None
        size = int(self.sizes_gb[model_id] * GB)
        weights = int(self.weights_gb.get(model_id, self.sizes_gb[model_id]) * GB)
        ops = self.operations.get(model_id, ("generate",))
        row, pool = self.claims_gb.get(model_id, (0.0, 0.0))
        return FakeEntry(
            model_id,
            estimate_bytes=size,
            weights_bytes=weights,
            operations=ops,
            kv_row_bytes=int(row * GB),
            kv_pool_bytes=int(pool * GB),
        )

    async def load(self, entry: Any, progress: LoadProgress) -> FakeUnit:
        self.num_loads += 1
        for fraction in self.progress_steps.get(entry.id, []):
            progress.report(fraction)
        gate = self.gates.get(entry.id)
        if gate is not None:
            await gate.wait()
        if self.unreachable:
            raise ConnectionError("node is not alive")
        if entry.id in self.failures:
            self.log.append(f"load-failed {entry.id}")
            raise RuntimeError(self.failures.pop(entry.id))
        self.log.append(f"load {entry.id}")
        unit = FakeUnit(entry.id, self.log, resumed=entry.id in self.saved)
        self.units[entry.id] = unit
        return unit

    def publish(self, name: str, payload: dict[str, Any]) -> None:
        self.events.append((name, payload))

    def clock(self) -> float:
        self.now += 1.0  # every reading is later than the one before: LRU order is call order
        return self.now

    def host(self, budget_gb: float, **options: Any) -> ResidencyHost[FakeUnit]:
        return ResidencyHost(
            budget_bytes=int(budget_gb * GB),
            source=self.entry,
            load=self.load,
            publish=self.publish,
            clock=self.clock,
            **options,
        )

    def loaded(self) -> list[str]:
        return [line.split()[1] for line in self.log if line.startswith("load ")]


async def settle() -> None:
    """Let every ready task run until nothing changes."""
    for _ in range(20):
        await asyncio.sleep(0)
