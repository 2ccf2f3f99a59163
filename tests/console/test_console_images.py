"""The console's chat sends an attached image: a user picks a file, asks about it, and the
vision model's answer reads it (Chromium, against the fake-tower model of tests/vision_fake.py)."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from live_server import LiveServer
from vision_fake import image_bytes, vision_model

from modelhost.assembly import build_serving
from modelhost.models.loaded import LoadedModel
from modelhost.server.settings import ServeSettings

sync_api = pytest.importorskip("playwright.sync_api")
expect = sync_api.expect

CHROMIUM = os.environ.get("MODELHOST_CHROMIUM") or shutil.which("chromium")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(CHROMIUM is None, reason="no chromium (make test installs it with apt)"),
]
WAIT_MS = 120_000


@pytest.fixture(scope="module")
def served(smollm2: LoadedModel) -> Iterator[LiveServer]:
    app = build_serving(vision_model(smollm2), ServeSettings(), batch=2)
    with LiveServer(app) as server:
        yield server


@pytest.fixture
def page() -> Iterator[Any]:
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM)
        page = browser.new_page()
        page.errors = []
        page.on("pageerror", lambda error: page.errors.append(str(error)))
        yield page
        browser.close()


def test_an_attached_image_is_sent_and_read(page: Any, served: LiveServer, tmp_path: Path) -> None:
    picture = tmp_path / "red.png"
    picture.write_bytes(image_bytes("red"))
    page.goto(served.base_url)
    page.click("nav a[data-view=playground]")
    page.fill("#chat-settings input[name=temperature]", "0")
    page.set_input_files("#chat-image", str(picture))
    expect(page.locator("#chat-attachments img")).to_have_count(1)
    page.fill("#chat-input", "Say the word you see:")
    page.keyboard.press("Enter")
    answer = page.locator(".msg.assistant").last
    expect(answer).to_have_attribute("data-finish", re.compile("stop|length"), timeout=WAIT_MS)
    expect(answer).to_contain_text("red")
    expect(page.locator(".msg.user img")).to_have_count(1)
    expect(page.locator("#chat-attachments img")).to_have_count(0)  # sent: the composer is clear
    assert page.errors == []
