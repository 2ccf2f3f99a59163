"""A model load's progress for a person waiting at a terminal: a bar redrawn on one line of
stderr, or (stderr not a terminal) a line for each tenth once the load has taken a moment."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TextIO

from modelhost.residency.unit import LoadProgress


class ProgressBar:
    """Called with the fraction done; draws `label [#####-----]  52%` over itself."""

    WIDTH = 30

    def __init__(self, label: str, stream: TextIO) -> None:
        self.label, self.stream = label, stream
        self.shown = -1

    def __call__(self, fraction: float) -> None:
        percent = int(min(1.0, max(0.0, fraction)) * 100)
        if percent == self.shown:
            return
        self.shown = percent
        filled = percent * self.WIDTH // 100
        bar = "#" * filled + "-" * (self.WIDTH - filled)
        self.stream.write(f"\rloading {self.label} [{bar}] {percent:3d}%")
        if percent == 100:
            self.stream.write("\n")
        self.stream.flush()


def load_reporter(label: str, stream: TextIO | None = None) -> Callable[[float], None]:
    """How to show `label`'s load on `stream` (stderr): a bar on a terminal, elsewhere a line
    `loading X: 40%` at each tenth once the load has taken a moment."""
    out = stream or sys.stderr
    if out.isatty():
        return ProgressBar(label, out)

    def say(percent: int) -> None:
        out.write(f"loading {label}: {percent}%\n")
        out.flush()

    return LoadProgress(label, say=say).report
