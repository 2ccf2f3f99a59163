"""Job kinds for the job-host tests: steps, failures, a gate, and children that hang or die.

Importable from the job's child process too (the manager hands the child the parent's path).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from modelhost.jobs.kinds import Emit, JobContext, JobKind

HERE = "job_test_kinds"


def accept(config: Mapping[str, Any]) -> dict[str, Any]:
    return dict(config)


async def steps(config: dict[str, Any], context: JobContext, emit: Emit) -> dict[str, Any]:
    count = int(config.get("steps", 3))
    for step in range(1, count + 1):
        await asyncio.sleep(float(config.get("delay_s", 0.0)))
        emit(
            {"type": "stage", "stage": "step", "progress": step / count, "message": f"step {step}"}
        )
    return {"summary": f"{count} steps"}


async def boom(config: dict[str, Any], context: JobContext, emit: Emit) -> dict[str, Any]:
    emit({"type": "log", "line": "about to fail"})
    raise ValueError("bad input")


async def gate(config: dict[str, Any], context: JobContext, emit: Emit) -> dict[str, Any]:
    """Waits until the file `config["gate"]` exists."""
    emit({"type": "stage", "stage": "waiting", "progress": 0.5, "message": "waiting for the gate"})
    while not Path(config["gate"]).exists():
        await asyncio.sleep(0.02)
    return {"summary": "gate opened"}


async def sleeper(config: dict[str, Any], context: JobContext, emit: Emit) -> dict[str, Any]:
    """A child that starts a grandchild, says both pids, and never finishes."""
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    emit({"type": "stage", "stage": "sleeping", "pid": os.getpid(), "grandchild": grandchild.pid})
    await asyncio.sleep(600)
    return {}


async def crash(config: dict[str, Any], context: JobContext, emit: Emit) -> dict[str, Any]:
    print("dying", file=sys.stderr, flush=True)
    os._exit(3)


async def child_steps(config: dict[str, Any], context: JobContext, emit: Emit) -> dict[str, Any]:
    print("this print must not break the event stream")
    emit({"type": "stage", "stage": "working", "progress": 0.5, "pid": os.getpid()})
    return {"summary": "child done", "output_dir": "/tmp/out"}


async def self_load(config: dict[str, Any], context: JobContext, emit: Emit) -> dict[str, Any]:
    """Streams chat completions from the server that runs it, one after another, forever."""
    import httpx

    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with httpx.AsyncClient(base_url=str(context.base_url), timeout=60) as client:
        while True:
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                emit({"type": "stage", "stage": "requesting", "status": response.status_code})
                async for _ in response.aiter_lines():
                    pass


def _kind(name: str, function: str, isolation: str = "task", exclusive: bool = False) -> JobKind:
    return JobKind(name, isolation, exclusive, accept, f"{HERE}:{function}")  # type: ignore[arg-type]


TEST_KINDS = {
    "steps": _kind("steps", "steps"),
    "boom": _kind("boom", "boom"),
    "gate": _kind("gate", "gate"),
    "exclusive-gate": _kind("exclusive-gate", "gate", exclusive=True),
    "sleeper": _kind("sleeper", "sleeper", "process"),
    "crash": _kind("crash", "crash", "process"),
    "child-steps": _kind("child-steps", "child_steps", "process"),
    "self-load": _kind("self-load", "self_load"),
}
