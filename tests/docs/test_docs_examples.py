"""The examples in README.md and docs/ work: every fenced block marked runnable (```bash run,
```python run) runs against a real server on a free 127.0.0.1 port, the routed app that
`modelhost serve` runs, over the embedded SmolLM2. `localhost:8080` and `127.0.0.1:8080` in
an example become that server's address; otherwise the reader's text is what runs.

One server for the module: the examples take seconds, not a model load each."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from live_server import LiveServer
from markdown_pages import Example, examples, pages

from modelhost.assembly import build_stage
from modelhost.models.loaded import LoadedModel
from modelhost.residency.host import ResidencyHost
from modelhost.residency.inprocess import InProcessUnit, in_process_loader
from modelhost.residency.registry import ModelRegistry
from modelhost.residency.router import ModelRouter
from modelhost.server.app import create_routed_app
from modelhost.server.settings import ServeSettings

pytestmark = pytest.mark.slow

SMOL = "smollm2-135m-instruct"
EXAMPLES = [example for page in pages() for example in examples(page)]
# A curl that gets an HTTP error exits non-zero, as a reader would notice the error: the
# examples say `curl -s` for their readers, the suite wants to know.
BASH_PRELUDE = 'curl() { command curl --silent --show-error --fail-with-body "$@"; }\n'
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def server(smollm2: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("docs")
    registry = ModelRegistry([], home=root / "home", hf_hub=root / "hub")

    def load(path: str, progress: Any = None) -> LoadedModel:
        # The session's SmolLM2; an example that asks for another model fails loudly here.
        entry = registry.get(SMOL)
        if entry is None or str(entry.path) != path:
            raise AssertionError(f"a docs example asked for a model other than {SMOL}: {path}")
        return smollm2

    settings = ServeSettings()
    host: ResidencyHost[InProcessUnit] = ResidencyHost(
        budget_bytes=4 << 30,
        source=registry.get,
        load=in_process_loader(load, lambda model: build_stage(model, settings, batch=4)),
    )
    router = ModelRouter(host, registry, current=SMOL)
    with LiveServer(create_routed_app(router, settings)) as live:
        yield f"127.0.0.1:{live.port}"


def test_the_docs_mark_examples_to_run() -> None:
    # The README's first requests at least: a marker renamed by mistake would run nothing.
    languages = {example.language for example in EXAMPLES if example.page.name == "README.md"}
    assert {"bash", "python"} <= languages


def _run(example: Example, address: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    code = example.code.replace("localhost:8080", address).replace("127.0.0.1:8080", address)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    if example.language == "python":
        command = [sys.executable, "-c", code]
    elif example.language in ("bash", "sh", "shell"):
        command = ["bash", "-euo", "pipefail", "-c", BASH_PRELUDE + code]
    else:
        raise AssertionError(f"{example.name}: no way to run a {example.language!r} example")
    return subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )


@pytest.mark.parametrize("example", EXAMPLES, ids=[example.name for example in EXAMPLES])
def test_every_runnable_example_runs_against_a_real_server(
    example: Example, server: str, tmp_path: Path
) -> None:
    done = _run(example, server, tmp_path)
    assert done.returncode == 0, f"{example.name} failed:\n{done.stdout}\n{done.stderr}"
