"""Stream frames rendered around their text are the frames `json.dumps` would have written."""

from __future__ import annotations

import json

import pytest

from modelhost.server.sse_frames import TextFrames, compact_json

TEXTS = [
    "",
    " world",
    'a "quoted" \\path\\',
    "line\nbreak\ttab\r",
    "\x00\x1f\x7f",
    "héllo ✓ 日本",
    "🦊",
]


def chunk(text: str) -> str:
    payload = {"id": "c-1", "choices": [{"index": 0, "delta": {"content": text}, "x": None}]}
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


@pytest.mark.parametrize("text", TEXTS)
def test_a_text_frame_is_the_frame_json_dumps_renders(text: str) -> None:
    frames = TextFrames(chunk)
    assert frames(text) == chunk(text)
    assert json.loads(frames(text)[len("data: ") :])["choices"][0]["delta"]["content"] == text


def test_compact_json_keeps_non_ascii_text_and_drops_spaces() -> None:
    assert compact_json({"a": [1, "é"], "b": None}) == '{"a":[1,"é"],"b":null}'


@pytest.mark.parametrize(
    "render",
    [lambda text: compact_json({"fixed": 1}), lambda text: compact_json([text, text])],
    ids=["text left out", "text written twice"],
)
def test_a_renderer_that_does_not_write_its_text_once_is_refused(render) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="once"):
        TextFrames(render)
