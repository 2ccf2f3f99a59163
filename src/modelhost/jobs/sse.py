"""A job's events as Server-Sent Events: the whole history, then live events, then `end`.

1. `retry: 1500`;
2. one `data:` frame per logged event, tailing the NDJSON log from a byte offset (a line
   still being written waits for its newline);
3. once the row is terminal, the rest of the log; when no terminal event was logged (a crash,
   a zombie), one synthesised from the row; a second terminal event is never sent;
4. `event: end` with `data: {}`.
A failure inside the stream becomes a `failed` frame, then `end`.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from modelhost.jobs.store import TERMINAL, ZOMBIE_ERROR, JobStore

RETRY = "retry: 1500\n\n"
END = "event: end\ndata: {}\n\n"
HEARTBEAT = ": keep-alive\n\n"
POLL_S = 0.2
TERMINAL_EVENTS = ("done", "failed")


def data_frame(event: dict[str, Any]) -> str:
    return f"data: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"


def synthesised_terminal(row: dict[str, Any]) -> dict[str, Any]:
    if row["status"] == "done":
        return {"type": "done", "ts": row["ended_at"], "output_dir": row["output_path"]}
    if row["status"] == "zombie":
        return {"type": "failed", "error": ZOMBIE_ERROR, "ts": row["ended_at"]}
    return {"type": "failed", "error": row["error"] or "job failed", "ts": row["ended_at"]}


async def job_frames(
    store: JobStore,
    job_id: str,
    changed: Callable[[float], Awaitable[None]],
    *,
    heartbeat_s: float = 15.0,
) -> AsyncIterator[str]:
    """The SSE frames of one job; `changed(timeout)` returns early when any job logs."""
    yield RETRY
    tail = _LogTail(store, job_id)
    terminal_sent = False
    quiet_since = time.monotonic()
    try:
        while True:
            row = store.get(job_id)  # read before the log: a terminal row's events are all in it
            if row is None:
                raise LookupError("job not found")
            finished = row["status"] in TERMINAL
            for event in tail.read(final=finished):
                if event.get("type") in TERMINAL_EVENTS:
                    if terminal_sent:
                        continue
                    terminal_sent = True
                quiet_since = time.monotonic()
                yield data_frame(event)
            if finished:
                if not terminal_sent:
                    yield data_frame(synthesised_terminal(row))
                break
            if time.monotonic() - quiet_since >= heartbeat_s:
                quiet_since = time.monotonic()
                yield HEARTBEAT
            await changed(POLL_S)
    except Exception as exc:
        if not terminal_sent:
            yield data_frame({"type": "failed", "error": f"{type(exc).__name__}: {exc}"})
    yield END


class _LogTail:
    """Complete NDJSON lines appended since the last read; undecodable lines are skipped."""

    def __init__(self, store: JobStore, job_id: str) -> None:
        self.path = store.log_path(job_id)
        self.offset = 0
        self.pending = b""

    def read(self, *, final: bool) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as log:
                log.seek(self.offset)
                chunk = log.read()
        except FileNotFoundError:
            chunk = b""
        self.offset += len(chunk)
        lines = (self.pending + chunk).split(b"\n")
        self.pending = lines.pop()
        if final and self.pending:  # the writer is gone: a last line without its newline
            lines.append(self.pending)
            self.pending = b""
        events = []
        for line in lines:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict):
                events.append(event)
        return events
