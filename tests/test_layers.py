"""The layers hold: no module imports a layer above its own (DESIGN.md's map, README "Layers").

A module may import its own package and any package ranked below it; packages of one rank sit
beside each other and never import each other. Lazy imports inside functions and imports for
type checking count too: an import that points up is a cycle waiting to happen.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import modelhost

ROOT = Path(modelhost.__file__).parent
ENTRY_POINTS = "entry points"  # the command line and its settings: they compose the layers
LAYERS = {
    "paths": 0,  # where MODELHOST_HOME is
    "bench": 0,  # the load generator: an HTTP client of any server
    "text": 1,
    "models": 2,
    "engine": 3,
    "inference": 4,
    "audio": 5,  # beside inference: a transcriber speaks inference's contracts
    "jobs": 6,  # beside residency
    "residency": 6,
    "server": 7,
    ENTRY_POINTS: 8,
}


def package_of(name: str) -> str:
    """A top-level package or module of modelhost, the entry points taken as one package."""
    if name.startswith("cli") or name in ("__main__", "serve_config", "cluster"):
        return ENTRY_POINTS
    return name


def modules() -> Iterator[tuple[str, Path]]:
    """(top-level package or module name, file) for every module of the tree."""
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts != ("__init__",):
            yield package_of(parts[0]), path


def imported(path: Path) -> Iterator[tuple[int, str]]:
    """(line, package) for every import of a modelhost package in `path`."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module == "modelhost":
            names = [f"modelhost.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "modelhost" and len(parts) > 1 and parts[1] != "__version__":
                yield node.lineno, package_of(parts[1])


def test_every_module_of_the_tree_has_a_layer():
    unplaced = sorted({package for package, _ in modules()} - set(LAYERS))
    assert unplaced == [], "give these a rank in LAYERS"


def test_no_module_imports_a_layer_above_its_own():
    upward = [
        f"{path.relative_to(ROOT)}:{line} imports {target}"
        for package, path in modules()
        for line, target in imported(path)
        if target != package and LAYERS[target] >= LAYERS[package]
    ]
    assert upward == []
