"""The console's Live view in a real browser (Debian's chromium, driven by Playwright): a line
per model that guessed ahead, with the share of its guesses kept."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from live_server import LiveServer

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
MODEL = "smollm2-135m-instruct"
COPY = "def area(w, h):\n    return w * h\n\nPrint the code above again, unchanged."


@pytest.fixture(scope="module")
def served(smollm2: LoadedModel) -> Iterator[LiveServer]:
    app = build_serving(smollm2, ServeSettings(speculate="ngram"), batch=2, max_queue=4)
    with LiveServer(app) as server:
        yield server


def test_the_live_view_shows_each_models_share_of_guesses_kept(served: Any) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": COPY}],
        "temperature": 0,
        "max_tokens": 40,
    }
    httpx.post(f"{served.base_url}/v1/chat/completions", json=body, timeout=120).raise_for_status()
    speculation = httpx.get(f"{served.base_url}/stats", timeout=30).json()["speculation"]
    kept = round(100 * speculation["accepted_tokens"] / speculation["draft_tokens"])
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM)
        try:
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.goto(f"{served.base_url}/#live")
            line = page.locator("#speculation li").first
            expect(line).to_contain_text(f"{MODEL}: speculation kept {kept}%", timeout=30_000)
            assert re.search(rf"of {speculation['draft_tokens']} guessed tokens", line.inner_text())
            assert errors == []
        finally:
            browser.close()
