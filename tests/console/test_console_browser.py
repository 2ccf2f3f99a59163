"""The console in a real browser (Debian's chromium, driven by Playwright) against real servers:
the embedded SmolLM2 and Gemma 3 behind one port, and a scripted model that says what a test
needs it to say. One browser for the module; each test opens its own page.

`MODELHOST_UPDATE_SCREENSHOT=1` also writes docs/console.md's screenshot (docs/console.png).
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from live_server import LiveServer
from scripted_engine import ScriptedEngine, scripted_model

from modelhost.assembly import build_app, build_stage
from modelhost.models.loaded import LoadedModel
from modelhost.models.loading.embedded import EMBEDDING_MODEL
from modelhost.models.loading.loader import load_model
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
SMOLLM2, GEMMA = "smollm2-135m-instruct", "gemma-3-270m"
LAPTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}
WAIT_MS = 120_000
SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "console.png"
HOSTILE = ["<script>", "window.pwned = 1", "</script>", '<img src="x" onerror="window.pwned=2">']


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def served(
    smollm2: LoadedModel, gemma3: LoadedModel, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    """SmolLM2 resident and current, Gemma 3 loadable (the suite's loaded copies), in-process;
    a private MODELHOST_HOME for the job store."""
    root = tmp_path_factory.mktemp("console")
    registry = ModelRegistry(
        [], home=root / "home", hf_hub=root / "hub", shape=ServingShape(batch=2)
    )
    settings = ServeSettings()
    loaded = {str(registry.get(m.id).path): m for m in (smollm2, gemma3)}  # type: ignore[union-attr]

    def load(path: str, **options: Any) -> LoadedModel:
        return loaded.get(path) or load_model(path, **options)

    def stage_for(model: LoadedModel) -> Any:
        return build_stage(model, settings, batch=2)

    host: ResidencyHost[InProcessUnit] = ResidencyHost(
        budget_bytes=4 * 10**9,
        source=registry.get,
        load=in_process_loader(load, stage_for),
        hold_s=0,
    )
    router = ModelRouter(host, registry, current=SMOLLM2)

    async def adopt() -> None:
        host.adopt(registry.get(SMOLLM2), InProcessUnit(stage_for(smollm2)))  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as env:
        env.setenv("MODELHOST_HOME", str(root / "home"))
        with LiveServer(create_routed_app(router, settings, adopt)) as server:
            yield server


@pytest.fixture(scope="module")
def scripted() -> Iterator[LiveServer]:
    """A model whose every answer is markup, one piece a token, with an API key and without."""
    with (
        LiveServer(build_app(ScriptedEngine(HOSTILE), scripted_model())) as open_server,
        LiveServer(
            build_app(ScriptedEngine(), scripted_model(), ServeSettings(api_key="sekret"))
        ) as keyed,
    ):
        yield open_server, keyed  # type: ignore[misc]


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A fresh tab at laptop width that records what the page logs as errors."""
    context = browser.new_context(viewport=LAPTOP)
    page = context.new_page()
    page.errors = []
    page.on("pageerror", lambda error: page.errors.append(str(error)))
    page.on("console", lambda m: page.errors.append(m.text) if m.type == "error" else None)
    yield page
    context.close()


def stats(server: LiveServer) -> dict[str, Any]:
    return httpx.get(f"{server.base_url}/stats", timeout=30).json()


def chat(page: Any, text: str) -> Any:
    page.click("nav a[data-view=playground]")
    page.fill("#chat-input", text)
    page.keyboard.press("Enter")
    return page.locator(".msg.assistant").last


def test_the_page_loads_every_view_without_an_error_at_laptop_and_phone_widths(page, served):
    page.goto(served.base_url)
    expect(page.locator(f"#models-table tr[data-model='{SMOLLM2}']")).to_contain_text("current")
    for width in (LAPTOP, PHONE):
        page.set_viewport_size(width)
        for view in ("models", "live", "playground", "jobs"):
            page.click(f"nav a[data-view={view}]")
            expect(page.locator(f"#view-{view}")).to_be_visible()
            overflow = page.evaluate("document.documentElement.scrollWidth - innerWidth")
            assert overflow <= 0, f"{view} is wider than {width['width']} px"
    page.set_viewport_size(LAPTOP)
    page.focus("nav a[data-view=models]")
    page.keyboard.press("Tab")  # the keyboard reaches the views' links in order
    assert page.evaluate("document.activeElement.dataset.view") == "live"
    page.keyboard.press("Enter")
    expect(page.locator("#view-live")).to_be_visible()
    assert page.errors == []


def test_the_models_view_marks_an_embedding_model_with_its_kind(page, served):
    page.goto(served.base_url)
    encoder = page.locator(f"#models-table tr[data-model='{EMBEDDING_MODEL}']")
    expect(encoder.locator(".badge")).to_have_text("embedding")
    chat = page.locator(f"#models-table tr[data-model='{SMOLLM2}']")
    expect(chat).to_contain_text("current")
    assert chat.locator(".badge").count() == 0


def test_a_chat_streams_an_answer_and_stop_frees_its_row(page, served):
    page.goto(f"{served.base_url}/#playground")
    page.fill("#chat-settings [name=max_tokens]", "48")
    answer = chat(page, "Hello! Who are you?")
    expect(answer).to_have_attribute("data-finish", re.compile("stop|length"), timeout=WAIT_MS)
    assert answer.locator(".text").last.inner_text().strip()
    assert re.search(
        r"TTFT [\d.]+ m?s · [\d.]+ tok/s", answer.locator(".figures-line").inner_text()
    )

    page.fill("#chat-settings [name=max_tokens]", "4000")
    page.fill("#chat-settings [name=temperature]", "0")
    long = chat(page, "Write a very long story about a dragon and a knight, at least 2000 words.")
    expect(long.locator(".text").last).not_to_be_empty(timeout=WAIT_MS)
    assert stats(served)["batch"]["active_rows"] == 1
    page.click("#chat-stop")
    expect(long).to_have_attribute("data-finish", "stopped")
    deadline = time.monotonic() + 10
    while stats(served)["batch"]["active_rows"] != 0:
        assert time.monotonic() < deadline, "the stopped row is still decoding"
        time.sleep(0.05)
    page.click("nav a[data-view=live]")  # the live view saw the client leave (499)
    expect(page.locator("#live-table tbody tr").first).to_contain_text("499")
    assert page.errors == []


def test_a_model_loaded_from_the_models_view_is_resident_and_unloading_frees_its_bytes(
    page, served
):
    page.goto(served.base_url)
    before = stats(served)["models"]["resident_bytes"]
    page.click(f"button[aria-label='Load {GEMMA}']")
    row = page.locator(f"#models-table tr[data-model='{GEMMA}']")
    expect(row).to_have_attribute("data-state", "resident", timeout=WAIT_MS)
    expect(page.locator("#budget")).to_contain_text(GEMMA)
    loaded = stats(served)["models"]
    assert GEMMA in [m["id"] for m in loaded["resident"]]
    assert loaded["resident_bytes"] > before
    if os.environ.get("MODELHOST_UPDATE_SCREENSHOT"):
        SCREENSHOT.parent.mkdir(exist_ok=True)
        page.screenshot(path=str(SCREENSHOT), clip={"x": 0, "y": 0, "width": 1280, "height": 460})
    page.click(f"button[aria-label='Unload {GEMMA}']")
    expect(row).to_have_attribute("data-state", "idle", timeout=WAIT_MS)
    expect(page.locator("#budget")).not_to_contain_text(GEMMA)
    after = stats(served)["models"]
    assert GEMMA not in [m["id"] for m in after["resident"]]
    assert after["resident_bytes"] < loaded["resident_bytes"]
    assert page.errors == []


def test_a_bench_job_started_from_the_jobs_view_shows_progress_and_a_plot(page, served):
    page.goto(f"{served.base_url}/#jobs")
    form = page.locator("#job-form")
    for name, value in (("concurrency", "1, 2"), ("requests", "2"), ("prompt_tokens", "16")):
        form.locator(f"[name={name}]").fill(value)
    form.locator("[name=max_tokens]").fill("8")
    form.locator("button[type=submit]").click()
    job = page.locator(".job[data-kind=bench-serve]").first
    expect(job).to_have_attribute("data-status", "done", timeout=WAIT_MS)
    assert job.locator("progress").evaluate("bar => bar.value") == 1
    plot = job.locator("svg.plot")
    expect(plot).to_be_visible()
    assert plot.locator("circle").count() == 4  # tok/s and TTFT at concurrency 1 and 2
    expect(job.locator("table")).to_contain_text("2/2")
    assert page.errors == []


def test_a_models_markup_is_shown_as_text_and_never_run(page, scripted):
    hostile, _ = scripted
    page.goto(hostile.base_url)
    answer = chat(page, "hi")
    expect(answer).to_have_attribute("data-finish", "stop", timeout=WAIT_MS)
    assert answer.locator(".text").last.text_content() == "".join(HOSTILE)
    assert page.locator("#chat-log script, #chat-log img").count() == 0
    assert page.evaluate("window.pwned") is None
    assert page.errors == []


def test_with_an_api_key_the_page_asks_for_it_and_shows_no_data_until_given(page, scripted):
    _, keyed = scripted
    page.goto(keyed.base_url)
    expect(page.locator("#key-prompt")).to_be_visible()
    assert page.locator("#models-table tbody tr").count() == 0
    assert page.locator("#server-info").text_content() == ""
    page.fill("#key-input", "wrong")
    page.keyboard.press("Enter")
    expect(page.locator("#key-error")).to_have_text("That key was refused.")
    page.fill("#key-input", "sekret")
    page.keyboard.press("Enter")
    expect(page.locator("#models-table tbody tr")).to_contain_text("scripted-model")
    expect(page.locator("#key-prompt")).to_be_hidden()
    assert page.evaluate("sessionStorage.getItem('modelhost.apiKey')") == "sekret"
    assert page.evaluate("localStorage.length") == 0  # kept for this tab only
