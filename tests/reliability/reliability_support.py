"""What the reliability tests share besides fixtures: request bodies and factory types."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
from starlette.applications import Starlette

AppFactory = Callable[..., Starlette]
ClientFactory = Callable[..., httpx.AsyncClient]
HELLO: dict[str, Any] = {"model": "scripted-model", "messages": [{"role": "user", "content": "hi"}]}
