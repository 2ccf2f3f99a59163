"""The job kinds: how each checks its config, where it runs, and the function that runs it.

A kind's `run` is named as "module:function" so a child process can import it by name:
`async def run(config, context, emit) -> dict`, where `emit(event)` reports progress and the
returned dict becomes the `done` event's extra fields (`summary`, `output_dir`, ...).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from modelhost.jobs.config import InvalidJob

Emit = Callable[[dict[str, Any]], None]
Runner = Callable[[dict[str, Any], "JobContext", Emit], Coroutine[Any, Any, dict[str, Any]]]


@dataclass(frozen=True, slots=True)
class JobContext:
    """What a running job may know about the server that started it."""

    base_url: str | None = None  # the server's own HTTP address; None when not listening
    api_key: str | None = None  # the key its own API wants, when it wants one


@dataclass(frozen=True, slots=True)
class JobKind:
    name: str
    isolation: Literal["process", "task"]  # a child process of its own, or an asyncio task
    exclusive: bool  # drives the served model: one such job at a time, the others wait queued
    validate: Callable[[Mapping[str, Any]], dict[str, Any]]  # raises InvalidJob
    run: str  # "module:function", importable in the server and in a child process

    def runner(self) -> Runner:
        module, _, function = self.run.partition(":")
        return getattr(importlib.import_module(module), function)


def _validator(path: str) -> Callable[[Mapping[str, Any]], dict[str, Any]]:
    def validate(config: Mapping[str, Any]) -> dict[str, Any]:
        module, _, function = path.partition(":")
        checked: dict[str, Any] = getattr(importlib.import_module(module), function)(config)
        return checked

    return validate


BUILTIN_KINDS: dict[str, JobKind] = {
    # A child process: the load generator must not share the server's event loop or GIL.
    "bench-serve": JobKind(
        "bench-serve",
        "process",
        True,
        _validator("modelhost.jobs.bench_serve:validate"),
        "modelhost.jobs.bench_serve:run",
    ),
    # HTTP calls that wait on the engine: cheap enough for a task in the server.
    "eval-serve": JobKind(
        "eval-serve",
        "task",
        True,
        _validator("modelhost.jobs.eval_serve:validate"),
        "modelhost.jobs.eval_serve:run",
    ),
    # Dequantizing and writing gigabytes: a child, so the server's loop never stalls.
    "convert": JobKind(
        "convert",
        "process",
        False,
        _validator("modelhost.jobs.convert:validate"),
        "modelhost.jobs.convert:run",
    ),
}


def checked_submission(
    kinds: Mapping[str, JobKind], kind: Any, config: Any
) -> tuple[JobKind, dict[str, Any]]:
    """The kind and its validated config, or InvalidJob with the reason."""
    if not isinstance(kind, str) or not kind:
        raise InvalidJob("kind must be a non-empty string")
    found = kinds.get(kind)
    if found is None:
        raise InvalidJob(f'unknown job kind "{kind}" (known: {", ".join(sorted(kinds))})')
    if config is None:
        config = {}
    if not isinstance(config, dict):
        raise InvalidJob("config must be an object")
    return found, found.validate(config)
