"""JSON for stream frames, and frames that differ from token to token only in their text.

A streamed answer sends one frame a token, and each was a `json.dumps` of a dict that is the
same but for one string: ~7 us warm, several times that between two decode steps whose kernels
have flushed the caches, on the event loop that shares the cores with those kernels.
`TextFrames` renders the frame once around a placeholder and then escapes only the text.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from json.encoder import encode_basestring  # what json.dumps(..., ensure_ascii=False) uses
from typing import Any

_COMPACT = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
_SLOT = "\ufdd0text\ufdd0"  # noncharacters: a placeholder no renderer writes on its own


def compact_json(value: Any) -> str:
    """`value` as JSON without spaces, non-ASCII text kept as it is (the wire's JSON)."""
    return _COMPACT.encode(value)


def named_event(name: str, payload: Mapping[str, Any]) -> str:
    """An SSE event named `name` whose data is `{type: name, ...payload}` (Anthropic's and the
    Responses API's frames)."""
    return f"event: {name}\ndata: {compact_json({'type': name, **payload})}\n\n"


class TextFrames:
    """`render(text)` for any text, at the cost of escaping the text.

    `render` must put its text into the frame once, as one JSON string rendered by
    `compact_json` (or `json.dumps` with `ensure_ascii=False`), and be the same for every text.
    """

    def __init__(self, render: Callable[[str], str]) -> None:
        head, slot, tail = render(_SLOT).partition(encode_basestring(_SLOT))
        if not slot or _SLOT in tail:
            raise ValueError("render must write its text once, as one JSON string")
        self._head = head
        self._tail = tail

    def __call__(self, text: str) -> str:
        return f"{self._head}{encode_basestring(text)}{self._tail}"
