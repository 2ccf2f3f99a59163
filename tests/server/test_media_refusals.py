"""Media content parts on a text-only model: refused with the reference's 400 messages, in each
surface's error shape, before anything is scheduled; files stay the 501 placement refusal."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from scripted_engine import ScriptedEngine

IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
AUDIO = {"type": "input_audio", "input_audio": {"data": "AA==", "format": "wav"}}
VIDEO = {"type": "video_url", "video_url": {"url": "https://example.com/a.mp4"}}
NO_AUDIO = (
    "model scripted-model has no audio tower — audio input needs a model whose config.json "
    "carries audio_config and whose sidecar ships the audio tensors (e.g. gemma-4 e4b OptiQ)"
)
NO_VIDEO = (
    "model scripted-model does not accept video input — video content parts need a "
    "Qwen3.5-family model (e.g. Qwen3.8-27B)"
)


def chat(*parts: dict[str, Any]) -> dict[str, Any]:
    content = [{"type": "text", "text": "Describe it."}, *parts]
    return {"model": "x", "messages": [{"role": "user", "content": content}]}


@pytest.mark.parametrize(
    ("parts", "message"),
    [
        ((AUDIO,), NO_AUDIO),
        ((VIDEO,), NO_VIDEO),
        ((VIDEO, AUDIO), "video and audio content parts cannot be combined"),
        ((IMAGE, AUDIO), NO_AUDIO),
        (({"type": "audio_url", "audio_url": {"url": "https://example.com/a.wav"}},), NO_AUDIO),
        (({"type": "video", "video": "https://example.com/a.mp4"},), NO_VIDEO),
    ],
)
async def test_chat_media_without_its_tower_is_a_400_with_the_reference_message(
    client: httpx.AsyncClient, engine: ScriptedEngine, parts: tuple[Any, ...], message: str
) -> None:
    response = await client.post("/v1/chat/completions", json=chat(*parts))
    assert response.status_code == 400
    assert response.json()["error"]["message"] == message
    assert engine.submissions == []


async def test_a_streamed_refusal_is_json_not_an_event_stream(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/chat/completions", json={**chat(AUDIO), "stream": True})
    assert response.status_code == 400
    assert response.headers["content-type"].startswith("application/json")


async def test_responses_audio_is_a_400_in_the_responses_error_shape(
    client: httpx.AsyncClient,
) -> None:
    part = {"type": "input_audio", "input_audio": {"data": "AA==", "format": "wav"}}
    body = {"model": "x", "input": [{"role": "user", "content": [part]}]}
    response = await client.post("/v1/responses", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == NO_AUDIO


async def test_a_file_part_stays_the_501_placement_refusal(client: httpx.AsyncClient) -> None:
    part = {"type": "file", "file": {"file_data": "data:application/pdf;base64,AA=="}}
    response = await client.post("/v1/chat/completions", json=chat(part))
    assert response.status_code == 501
    assert response.json()["error"]["reasons"] == ["media-batch-unsupported"]
