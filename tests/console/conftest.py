"""The console's browser tests share two cores with the other test worker and the server they
drive: an assertion waits up to 30 s for the page to show what it asserts, not Playwright's 5 s
(every wait for a model or an answer names its own, longer, timeout)."""

from __future__ import annotations

import pytest

sync_api = pytest.importorskip("playwright.sync_api")
sync_api.expect.set_options(timeout=30_000)
