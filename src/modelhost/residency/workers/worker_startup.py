"""Where a worker's start went: the moments it passed, and the phases between them.

The worker writes its moments (wall-clock seconds) beside its socket as it passes them
(`StartupMarks.mark`); the parent adds its own (`asked`: the load began; `spawned`: a process
was started or a spare handed its arguments; `healthy`: the worker answered) and reads the
phases, in milliseconds, that `GET /engine` shows for each worker:

- `spare_wait_ms`: asked → spawned (waiting for a spare still warming up);
- `python_ms`: spawned → the worker's main running (the interpreter and its first imports;
  about nothing for a spare);
- `imports_ms`: → PyTorch, the kernels and the server imported (about nothing for a spare);
- `weights_ms`: → the model loaded (weights and tokenizer);
- `engine_ms`: → its engine built (the KV pool);
- `listen_ms`: → the worker answering the parent's health check.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

STARTUP_FILE = "startup.json"  # beside the worker's socket
PHASES = (
    ("spare_wait_ms", "asked", "spawned"),
    ("python_ms", "spawned", "main"),
    ("imports_ms", "main", "imported"),
    ("weights_ms", "imported", "loaded"),
    ("engine_ms", "loaded", "engine"),
    ("listen_ms", "engine", "healthy"),
)


class StartupMarks:
    """The worker's side: each moment added to the file, replaced whole."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.marks: dict[str, float] = {}

    def mark(self, name: str) -> None:
        self.marks[name] = time.time()
        partial = self.path.with_suffix(".partial")
        with contextlib.suppress(OSError):  # a figure for views; never worth failing a start
            partial.write_text(json.dumps(self.marks))
            partial.replace(self.path)


def startup_phases(path: Path, parent_marks: dict[str, float]) -> dict[str, float]:
    """The phases (ms) whose two moments are known, from the worker's file and the parent's."""
    marks = dict(parent_marks)
    with contextlib.suppress(OSError, ValueError):
        written = json.loads(path.read_text())
        if isinstance(written, dict):
            marks.update({k: float(v) for k, v in written.items() if isinstance(v, int | float)})
    return {  # never below 0: a spare may be running its main as the parent notes its hand-over
        name: round(max(0.0, marks[end] - marks[start]) * 1000, 1)
        for name, start, end in PHASES
        if start in marks and end in marks
    }
