"""A job's child process: `python -m modelhost.jobs.child`, started by the job manager.

The parent writes one JSON line to stdin (`run`, `config`, `context`) and keeps the pipe open;
the child leads its own process group and stops that whole group when the pipe ends, so a
parent that dies takes its jobs with it. Events go to stdout, one JSON line each, ending in
`{"type": "result", "fields": {...}}` or `{"type": "error", "error": "<Name>: <message>"}`.
Anything else that writes to stdout is sent to stderr instead, so it cannot corrupt the events.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
from typing import Any

from modelhost.jobs.kinds import JobContext, JobKind


def _watch_parent() -> None:
    """Block until the parent's end of stdin closes, then stop this process group. Reads the
    raw descriptor: a thread parked in a buffered reader breaks interpreter shutdown."""
    while os.read(0, 4096):
        pass
    os.killpg(os.getpgrp(), signal.SIGTERM)


def _read_line(fd: int) -> bytes:
    """One line from `fd`, unbuffered, so nothing past it is taken from the pipe."""
    line = bytearray()
    while not line.endswith(b"\n"):
        chunk = os.read(fd, 1)
        if not chunk:
            break
        line += chunk
    return bytes(line)


def main() -> int:
    spec = json.loads(_read_line(0))
    events = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)  # stray prints (libraries, progress bars) land in stderr
    sys.stdout = sys.stderr
    threading.Thread(target=_watch_parent, name="parent-watch", daemon=True).start()

    def emit(event: dict[str, Any]) -> None:
        events.write(json.dumps(event, ensure_ascii=False, separators=(",", ":")) + "\n")

    kind = JobKind("child", "process", False, dict, spec["run"])
    context = JobContext(**spec["context"])
    try:
        fields = asyncio.run(kind.runner()(spec["config"], context, emit))
    except BaseException as exc:  # reported as the job's failure, whatever it was
        emit({"type": "error", "error": f"{type(exc).__name__}: {exc}"})
        return 1
    emit({"type": "result", "fields": fields or {}})
    return 0


if __name__ == "__main__":
    code = main()
    sys.stderr.flush()
    os._exit(code)  # the parent-watch thread is still blocked reading; no teardown needed
