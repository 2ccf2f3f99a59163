"""The reference tables follow the code: every `modelhost serve` flag, every route the server
answers and every MODELHOST_ environment variable the sources read is in its table, and the
tables name nothing that is gone. A new flag, route or variable fails here until it is written
down in its one place."""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

from markdown_pages import DOCS, ROOT, first_cells, section

from modelhost.cli.main import build_parser
from modelhost.residency.host import ResidencyHost
from modelhost.residency.inprocess import InProcessUnit
from modelhost.residency.registry import ModelRegistry
from modelhost.residency.router import ModelRouter
from modelhost.server.app import create_routed_app
from modelhost.server.settings import ServeSettings

CONFIGURATION = DOCS / "configuration.md"
API = DOCS / "api.md"
FLAG = re.compile(r"--[a-z0-9][a-z0-9-]*")
ROUTE = re.compile(r"\b(GET|POST|DELETE|PUT|PATCH) (/[^\s`,]*)")
ENV_NAME = re.compile(r"MODELHOST_[A-Z0-9_]+")


def serve_flags() -> set[str]:
    """`modelhost serve`'s options as main() parses them (main adds --threads to serve_args')."""
    commands = next(
        action for action in build_parser()._actions
        if isinstance(action, argparse._SubParsersAction)
    )  # fmt: skip
    serve = commands.choices["serve"]
    return {
        option
        for action in serve._actions
        for option in action.option_strings
        if option.startswith("--") and option != "--help"
    }


def documented(page: Path, heading: str, pattern: re.Pattern[str]) -> set[str]:
    return {
        found for cell in first_cells(section(page, heading)) for found in pattern.findall(cell)
    }


def test_every_serve_flag_is_in_the_flags_table_and_the_table_names_no_other() -> None:
    listed = documented(CONFIGURATION, "`modelhost serve` flags", FLAG)
    assert sorted(serve_flags() - listed) == [], "flags missing from docs/configuration.md"
    assert sorted(listed - serve_flags()) == [], "docs/configuration.md lists flags serve lacks"


def _template(path: str) -> str:
    # Parameter names and converters are the code's business: `{model_id:path}` == `{id}`.
    return re.sub(r"\{[^}]*\}", "{}", path)


def served_routes(tmp_path: Path) -> set[str]:
    """METHOD /path of every route the routed app (what `modelhost serve` runs) answers: the
    surfaces' routes and the front's own (metrics, residency, jobs, console)."""
    registry = ModelRegistry(home=tmp_path / "home", hf_hub=tmp_path / "hub", embedded=False)

    async def never_loads(entry: object, progress: object) -> InProcessUnit:
        raise AssertionError("listing routes loads no model")

    host: ResidencyHost[InProcessUnit] = ResidencyHost(
        budget_bytes=10**9, source=registry.get, load=never_loads
    )
    app = create_routed_app(ModelRouter(host, registry, current="none"), ServeSettings())
    return {
        f"{method} {_template(route.path)}"
        for route in app.routes
        for method in getattr(route, "methods", None) or ()
        if method != "HEAD"  # Starlette adds HEAD to every GET
    }


def test_every_route_is_in_the_api_route_table_and_the_table_names_no_other(
    tmp_path: Path,
) -> None:
    listed = {
        f"{method} {_template(path)}"
        for cell in first_cells(section(API, "Routes"))
        for method, path in ROUTE.findall(cell)
    }
    served = served_routes(tmp_path)
    assert sorted(served - listed) == [], "routes missing from docs/api.md's route table"
    assert sorted(listed - served) == [], "docs/api.md lists routes the server does not answer"


def environment_variables_read() -> set[str]:
    """MODELHOST_ names the sources hold as a whole string: what os.environ is asked for (a
    name kept in a constant first, as cluster_secret.py's, counts too); names inside prose,
    such as `MODELHOST_HOME/kv` in a docstring, do not."""
    names = set()
    for path in (ROOT / "src").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            is_text = isinstance(node, ast.Constant) and isinstance(node.value, str)
            if is_text and ENV_NAME.fullmatch(node.value):
                names.add(node.value)
    return names


def test_every_environment_variable_is_in_the_table_and_the_table_names_no_other() -> None:
    listed = documented(CONFIGURATION, "Environment variables", ENV_NAME)
    read = environment_variables_read()
    assert read, "the sources read MODELHOST_HOME at least: the scan is broken"
    assert sorted(read - listed) == [], "variables missing from docs/configuration.md"
    assert sorted(listed - read) == [], "docs/configuration.md lists variables no source reads"
