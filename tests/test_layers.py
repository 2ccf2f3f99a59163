"""The layers hold: no module imports a layer above its own (DESIGN.md's map,
CONTRIBUTING.md "Layers"), no two files import each other round a circle, and no folder grows
past a reader's glance.

A module may import its own package and any package ranked below it; packages of one rank sit
beside each other and never import each other. Lazy imports inside functions and imports for
type checking count for the ranks: an import that points up is a cycle waiting to happen. For
circles between files, only imports under `if TYPE_CHECKING:` are left out (they never run).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import modelhost

ROOT = Path(modelhost.__file__).parent
MAX_MODULES_PER_FOLDER = 15
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
    "serve_config": 8,  # the serve settings, read once from arguments or a worker's --config
    "cluster": 9,  # Ray: the front of several machines, handed its launch by the assembly
    "assembly": 10,  # builds the stage, the app, the worker launch and the cluster's front
    "cli": 11,  # the command line and the worker entry: parse, then ask the assembly
    "__main__": 12,
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> Iterator[tuple[str, Path]]:
    """(top-level package or module name, file) for every module of the tree."""
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts != ("__init__",):
            yield parts[0], path


def imported_names(path: Path, *, run_time_only: bool = False) -> Iterator[tuple[int, str]]:
    """(line, dotted name) for every import of modelhost in `path`; `run_time_only` leaves out
    those under `if TYPE_CHECKING:`. `from a import b` gives `a.b` (a module or a name in a)."""
    tree = ast.parse(path.read_text(), str(path))
    skipped: set[int] = set()
    if run_time_only:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and _is_type_checking(node.test):
                skipped.update(id(inner) for stmt in node.body for inner in ast.walk(stmt))
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if name.startswith("modelhost.") and name != "modelhost.__version__":
                yield node.lineno, name


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def file_graph() -> dict[str, set[str]]:
    """Module → the modules of the tree it imports when it runs (a name imported from a module
    counts as that module; a package's `__init__` counts as the package)."""
    files = {module_name(path): path for _, path in modules()}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        targets = set()
        for _, dotted in imported_names(path, run_time_only=True):
            target = dotted if dotted in files else dotted.rpartition(".")[0]
            if target in files and target != name:
                targets.add(target)
        graph[name] = targets
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_every_module_of_the_tree_has_a_layer():
    unplaced = sorted({package for package, _ in modules()} - set(LAYERS))
    assert unplaced == [], "give these a rank in LAYERS"


def test_no_module_imports_a_layer_above_its_own():
    upward = [
        f"{path.relative_to(ROOT)}:{line} imports {target}"
        for package, path in modules()
        for line, name in imported_names(path)
        if (target := name.split(".")[1]) != package and LAYERS[target] >= LAYERS[package]
    ]
    assert upward == []


def test_no_two_files_import_each_other_round_a_circle():
    assert circles(file_graph()) == []


def test_the_circle_finder_sees_a_circle_of_three_files():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]


def test_no_folder_holds_more_than_fifteen_modules_side_by_side():
    crowded = {
        str(folder.relative_to(ROOT.parent)): count
        for folder in [ROOT, *(p for p in ROOT.rglob("*") if p.is_dir())]
        if (count := sum(1 for f in folder.glob("*.py") if f.name != "__init__.py"))
        > MAX_MODULES_PER_FOLDER
    }
    assert crowded == {}
