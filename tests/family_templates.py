"""The family template fixtures (tests/fixtures/templates/), read once."""

from __future__ import annotations

from functools import cache
from pathlib import Path

TEMPLATES = Path(__file__).resolve().parent / "fixtures" / "templates"


@cache
def template(name: str) -> str:
    """The fixture template `name` (e.g. "qwen3"), as a model file would carry it."""
    return (TEMPLATES / f"{name}.jinja").read_text()
