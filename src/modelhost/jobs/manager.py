"""The job host: submits, runs, cancels and closes jobs, and records every event.

Every job runs as an asyncio task on the server's loop. A `task` kind's function runs right
there; a `process` kind's runs in `python -m modelhost.jobs.child`, a child that leads its own
process group, and is ended with that group (SIGTERM, then SIGKILL after a grace period).
Kinds marked exclusive drive the served model, so they run one at a time: a second one waits
`queued` until the first has ended. Each event is appended to the job's NDJSON log before the row
changes, so a reader that sees a terminal row finds the terminal event already logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import asdict
from typing import Any

from modelhost.jobs.kinds import BUILTIN_KINDS, Emit, JobContext, JobKind, checked_submission
from modelhost.jobs.store import TERMINAL, JobStore, utc_now

KILL_GRACE_S = 3.0  # SIGTERM, then SIGKILL after this long
CLOSE_WAIT_S = 10.0  # how long shutdown waits for jobs to record their end
CANCELLED = "job cancelled"
HOST_CLOSED = "job host closed"

# Holds what a job needs for its whole run (a model lease, say); given the validated config.
Hold = Callable[[dict[str, Any]], contextlib.AbstractAsyncContextManager[Any]]


class JobManager:
    def __init__(
        self,
        store: JobStore | Callable[[], JobStore],
        *,
        context: Callable[[], JobContext] = JobContext,
        kinds: Mapping[str, JobKind] | None = None,
        hold: Hold | None = None,
    ) -> None:
        self._store = store if isinstance(store, JobStore) else None
        self._open_store = store if not isinstance(store, JobStore) else None
        self.kinds = dict(BUILTIN_KINDS if kinds is None else kinds)
        self._context = context
        self._hold = hold
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._stop_reason: dict[str, str] = {}
        self._exclusive = asyncio.Lock()
        self._changed = asyncio.Event()
        self._closed = False

    @property
    def store(self) -> JobStore:
        """Opened on first use, as the first job route does: jobs a previous process left
        queued or running become zombies then, and a server nobody asks about jobs never
        touches the database."""
        if self._store is None:
            assert self._open_store is not None
            store = self._open_store()
            store.mark_zombies()
            self._store = store
        return self._store

    # ---- requests ---------------------------------------------------------------------------

    def submit(self, kind: Any, config: Any) -> dict[str, Any]:
        """Queue a job and start it; raises InvalidJob (a 400) before anything is recorded."""
        if self._closed:
            raise RuntimeError(HOST_CLOSED)
        job_kind, checked = checked_submission(self.kinds, kind, config)
        row = self.store.create(job_kind.name, checked)
        job_id = row["id"]
        self._tasks[job_id] = asyncio.create_task(self._run(job_id, job_kind, checked))
        return row

    async def cancel(self, job_id: str) -> bool:
        """End a queued or running job (its child's whole process group too); False when it
        had already ended. Returns after the job has recorded its end."""
        return await self._stop(job_id, CANCELLED)

    async def stop_all(self) -> None:
        """Shutdown begins: every unfinished job ends as failed, its child processes killed,
        and no new job starts. The store stays readable."""
        self._closed = True
        await asyncio.gather(*(self._stop(job_id, HOST_CLOSED) for job_id in list(self._tasks)))

    async def close(self) -> None:
        """`stop_all`, then the store is closed."""
        await self.stop_all()
        if self._store is not None:
            self._store.close()
            self._store = None
            self._open_store = None  # closed for good: a later route fails instead

    async def changed(self, timeout_s: float) -> None:
        """Wait until any job records an event, or `timeout_s` passes."""
        event = self._changed
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout_s)

    async def _stop(self, job_id: str, reason: str) -> bool:
        task = self._tasks.get(job_id)
        if task is None or task.done():
            return False
        self._stop_reason.setdefault(job_id, reason)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, TimeoutError):
            await asyncio.wait_for(asyncio.shield(task), CLOSE_WAIT_S)
        return True

    # ---- one job ----------------------------------------------------------------------------

    async def _run(self, job_id: str, kind: JobKind, config: dict[str, Any]) -> None:
        try:
            if kind.exclusive:
                async with self._exclusive:
                    await self._execute(job_id, kind, config)
            else:
                await self._execute(job_id, kind, config)
        except asyncio.CancelledError:
            self._fail(job_id, self._stop_reason.get(job_id, HOST_CLOSED))
        except JobFailed as exc:  # a child's report, already "<Name>: <message>" or an exit
            self._fail(job_id, str(exc))
        except Exception as exc:
            self._fail(job_id, f"{type(exc).__name__}: {exc}")
        finally:
            self._tasks.pop(job_id, None)
            self._stop_reason.pop(job_id, None)

    async def _execute(self, job_id: str, kind: JobKind, config: dict[str, Any]) -> None:
        self.store.update(job_id, status="running")
        self._record(job_id, {"type": "started", "ts": utc_now()})
        context = self._context()
        async with self._held(config):
            if kind.isolation == "process":
                fields = await self._run_child(job_id, kind, config, context)
            else:
                fields = await kind.runner()(config, context, self._emitter(job_id))
        done = {"type": "done", "ts": utc_now(), **(fields or {})}
        self._record(job_id, done)
        self.store.update(
            job_id,
            status="done",
            progress=1.0,
            ended_at=done["ts"],
            output_path=done.get("output_dir"),
        )
        self._notify()

    def _held(self, config: dict[str, Any]) -> contextlib.AbstractAsyncContextManager[Any]:
        if self._hold is None or config.get("url"):  # a job aimed at another server holds nothing
            return contextlib.nullcontext()
        return self._hold(config)

    async def _run_child(
        self, job_id: str, kind: JobKind, config: dict[str, Any], context: JobContext
    ) -> dict[str, Any]:
        emit = self._emitter(job_id)
        async with _child_process() as child:
            spec = {"run": kind.run, "config": config, "context": asdict(context)}
            assert child.stdin is not None and child.stdout is not None
            child.stdin.write(json.dumps(spec).encode() + b"\n")
            await child.stdin.drain()  # the pipe stays open: its end tells the child to stop
            stderr_tail: deque[str] = deque(maxlen=20)
            reading = asyncio.create_task(_collect_stderr(child, stderr_tail, emit))
            outcome: dict[str, Any] | None = None
            try:
                async for line in child.stdout:
                    try:
                        event = json.loads(line)
                    except ValueError:
                        continue  # not ours: the child routes stray output to stderr
                    if event.get("type") in ("result", "error"):
                        outcome = event
                    else:
                        emit(event)
                code = await child.wait()
                await reading
            finally:
                reading.cancel()
        if outcome is not None and outcome["type"] == "result":
            return dict(outcome.get("fields") or {})
        if outcome is not None:
            raise JobFailed(str(outcome.get("error")))
        detail = f": {stderr_tail[-1]}" if stderr_tail else ""
        raise JobFailed(f"exited {code}{detail}")

    # ---- events -----------------------------------------------------------------------------

    def _emitter(self, job_id: str) -> Emit:
        def emit(event: dict[str, Any]) -> None:
            if event.get("type") in ("started", "done", "failed"):
                event = {**event, "type": "log"}  # the manager alone records the lifecycle
            self._record(job_id, event)
            changes: dict[str, Any] = {}
            if event.get("type") in ("stage", "metric"):
                if isinstance(event.get("progress"), int | float):
                    changes["progress"] = float(event["progress"])
                if isinstance(event.get("message"), str):
                    changes["message"] = event["message"]
            self.store.update(job_id, **changes)
            self._notify()

        return emit

    def _record(self, job_id: str, event: dict[str, Any]) -> None:
        self.store.append_event(job_id, event)

    def _fail(self, job_id: str, error: str) -> None:
        row = self.store.get(job_id)
        if row is None or row["status"] in TERMINAL:
            return
        failed = {"type": "failed", "error": error, "ts": utc_now()}
        self._record(job_id, failed)
        self.store.update(job_id, status="failed", error=error, ended_at=failed["ts"])
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()


class JobFailed(Exception):
    """A child process reported an error or exited without a result; the message says which.
    Recorded as the bare message (the child already named the exception)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "job failed"


@contextlib.asynccontextmanager
async def _child_process() -> AsyncIterator[asyncio.subprocess.Process]:
    """The child in its own process group; on the way out (cancel, failure, shutdown) the
    whole group gets SIGTERM, then SIGKILL, and the child is reaped."""
    env = dict(os.environ)
    # The child imports what the parent can (kinds may live outside the installed package).
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "modelhost.jobs.child",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
        env=env,
    )
    try:
        yield child
    finally:
        await asyncio.shield(_end_group(child))


async def _end_group(child: asyncio.subprocess.Process) -> None:
    if child.returncode is None:
        _signal_group(child.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(child.wait(), KILL_GRACE_S)
        except TimeoutError:
            _signal_group(child.pid, signal.SIGKILL)
            await child.wait()
    else:
        _signal_group(child.pid, signal.SIGKILL)  # grandchildren the child left behind
    if child.stdin is not None:
        child.stdin.close()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


async def _collect_stderr(child: asyncio.subprocess.Process, tail: deque[str], emit: Emit) -> None:
    assert child.stderr is not None
    async for raw in child.stderr:
        line = raw.decode("utf-8", "replace").rstrip()
        if line:
            tail.append(line)
            emit({"type": "log", "line": line})
