"""The console's LoRA adapters in a real browser (Debian's chromium, driven by Playwright)
against a real server (a tiny base in-process, tiny PEFT adapters): a served adapter is listed
under its base and unloads by its button; an adapter the base cannot serve, loaded from the
form, shows the server's refusal in words."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from live_server import LiveServer
from tiny_lora import make_peft_adapter

from modelhost.assembly import build_stage
from modelhost.models.loading.loader import load_model
from modelhost.residency.adapter_catalog import AdapterCatalog
from modelhost.residency.host import ResidencyHost
from modelhost.residency.inprocess import InProcessUnit, in_process_loader
from modelhost.residency.registry import ModelRegistry, ServingShape
from modelhost.residency.router import ModelRouter
from modelhost.server.app import create_routed_app
from modelhost.server.settings import ServeSettings

sync_api = pytest.importorskip("playwright.sync_api")
expect = sync_api.expect

CHROMIUM = os.environ.get("MODELHOST_CHROMIUM") or shutil.which("chromium")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(CHROMIUM is None, reason="no chromium (make test installs it with apt)"),
]
BASE = "tiny-a"
WAIT_MS = 120_000


@pytest.fixture(scope="module")
def adapters(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """`tone`, served from the start; `head`, which trains the LM head (no base can take it)."""
    root = tmp_path_factory.mktemp("console-adapters")
    make_peft_adapter(models_dir / BASE, root / "tone", seed=1)
    make_peft_adapter(models_dir / BASE, root / "head", seed=2, targets=("q_proj", "lm_head"))
    return {"tone": root / "tone", "head": root / "head"}


@pytest.fixture(scope="module")
def served(
    models_dir: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    """tiny-a current with `tone`, in-process, as `serve tiny-a --adapter tone=...` is."""
    home = tmp_path_factory.mktemp("console-adapters-home")
    registry = ModelRegistry([models_dir], home=home, embedded=False, shape=ServingShape(batch=2))
    settings = ServeSettings(adapters=(("tone", BASE, str(adapters["tone"].resolve())),))
    host: ResidencyHost[InProcessUnit] = ResidencyHost(
        budget_bytes=4 << 30,
        source=registry.get,
        load=in_process_loader(load_model, lambda m: build_stage(m, settings, batch=2)),
    )
    router = ModelRouter(host, registry, BASE, adapters=AdapterCatalog(settings.adapters))
    with LiveServer(create_routed_app(router, settings)) as server:
        loaded = httpx.post(f"{server.base_url}/api/models/{BASE}/load", json={}, timeout=300)
        assert loaded.status_code == 200, loaded.text
        yield server


@pytest.fixture
def page(served: LiveServer) -> Iterator[Any]:
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM)
        page = browser.new_page()
        page.errors = []
        page.on("pageerror", lambda error: page.errors.append(str(error)))
        page.goto(served.base_url)
        page.click("nav a[data-view=models]")
        yield page
        browser.close()


def test_a_served_adapter_is_listed_under_its_base_and_unloads_by_its_button(
    page: Any, served: LiveServer, adapters: dict[str, Path]
) -> None:
    item = page.locator(f"#models-table tr.adapters[data-base='{BASE}'] li[data-adapter='tone']")
    expect(item).to_contain_text("loaded", timeout=WAIT_MS)
    expect(item).to_contain_text(str(adapters["tone"].resolve()))
    expect(item).to_contain_text("0 running")
    expect(page.locator("#models-table tr[data-model='tone']")).to_have_count(0)
    page.click("button[aria-label='Unload adapter tone']")
    expect(item).to_have_count(0, timeout=WAIT_MS)
    listed = httpx.get(f"{served.base_url}/api/adapters", timeout=30).json()["data"]
    assert "tone" not in {row["name"] for row in listed}
    assert page.errors == []


def test_an_adapter_the_base_cannot_serve_shows_the_servers_refusal(
    page: Any, adapters: dict[str, Path]
) -> None:
    expect(page.locator(f"#adapter-model option[value='{BASE}']")).to_have_count(1)
    page.select_option("#adapter-model", BASE)
    page.fill("#adapter-name", "head")
    page.fill("#adapter-path", str(adapters["head"]))
    page.click("#adapter-button")
    status = page.locator("#adapter-status")
    expect(status).to_contain_text("cannot patch", timeout=WAIT_MS)
    expect(status).to_have_class("error small")
    expect(page.locator("li[data-adapter='head']")).to_have_count(0)
    assert page.errors == []
