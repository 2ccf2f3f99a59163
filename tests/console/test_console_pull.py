"""The console's pull field in a real browser (chromium, Playwright) against a real server and
a stand-in hub (HF_ENDPOINT): a repo typed in is pulled with a progress bar and joins the
models table; a refusal is shown as the server words it."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from typing import Any

import pytest
from live_server import LiveServer
from pull_world import GGUF_REPO, ODD_REPO, hub, hub_files

from modelhost.assembly import build_stage
from modelhost.models.loading.loader import load_model
from modelhost.residency.host import ResidencyHost
from modelhost.residency.inprocess import InProcessUnit, in_process_loader
from modelhost.residency.registry import ModelRegistry, ServingShape
from modelhost.residency.router import ModelRouter
from modelhost.server.app import create_routed_app
from modelhost.server.settings import ServeSettings

sync_api = pytest.importorskip("playwright.sync_api")
expect = sync_api.expect

__all__ = ["hub", "hub_files"]  # fixtures
CHROMIUM = os.environ.get("MODELHOST_CHROMIUM") or shutil.which("chromium")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(CHROMIUM is None, reason="no chromium (make test installs it with apt)"),
]
WAIT_MS = 120_000


@pytest.fixture
def served(hub, models_dir, tmp_path) -> Iterator[LiveServer]:
    registry = ModelRegistry(
        [models_dir], home=tmp_path / "home", embedded=False, shape=ServingShape(batch=2)
    )
    settings = ServeSettings()
    host: ResidencyHost[InProcessUnit] = ResidencyHost(
        budget_bytes=4 << 30,
        source=registry.get,
        load=in_process_loader(load_model, lambda m: build_stage(m, settings, batch=2)),
    )
    with LiveServer(create_routed_app(ModelRouter(host, registry, "tiny-a"), settings)) as server:
        yield server


@pytest.fixture
def page(served) -> Iterator[Any]:
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM)
        page = browser.new_page()
        page.errors = []
        page.on("pageerror", lambda error: page.errors.append(str(error)))
        page.goto(served.base_url)
        page.click("nav a[data-view=models]")
        yield page
        browser.close()


def test_a_repo_typed_into_the_models_view_is_pulled_with_a_bar_and_listed(page):
    page.fill("#pull-model", f"hf.co/{GGUF_REPO}:Q8_0")
    page.click("#pull-button")
    expect(page.locator("#models-table tr[data-model='Tiny-Q8_0']")).to_be_visible(timeout=WAIT_MS)
    expect(page.locator("#pull-status")).to_contain_text("success")
    assert page.locator("#pull-progress").evaluate("bar => bar.value") == 1
    assert page.errors == []


def test_a_refused_pull_shows_the_servers_reason(page):
    page.fill("#pull-model", ODD_REPO)
    page.click("#pull-button")
    expect(page.locator("#pull-status")).to_contain_text("cannot be served", timeout=WAIT_MS)
    expect(page.locator("#pull-progress")).to_be_hidden()
