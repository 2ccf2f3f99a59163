"""Where modelhost keeps its files."""

from __future__ import annotations

import os
from pathlib import Path


def modelhost_home() -> Path:
    """`MODELHOST_HOME`, default ~/.modelhost: db/, jobs/, models/, cache/."""
    return Path(os.environ.get("MODELHOST_HOME") or Path.home() / ".modelhost")
