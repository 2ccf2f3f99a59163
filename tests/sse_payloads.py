"""Reading an SSE body as a client would: the decoded `data:` payloads of its frames."""

from __future__ import annotations

import json
from typing import Any


def sse_data(text: str) -> list[Any]:
    """The decoded `data:` payloads of an SSE body (without `[DONE]`)."""
    return [
        json.loads(line.removeprefix("data: "))
        for frame in text.split("\n\n")
        for line in frame.split("\n")
        if line.startswith("data: ") and line != "data: [DONE]"
    ]
