"""Media content parts: which kind each part type is, and the 400 for a model that cannot take it.

Every surface records the kinds of media its request carries (`InferenceRequest.media`), so no
part is ever silently dropped: a model without the tower a kind needs refuses it with a 400 in
the surface's own error shape, before anything is scheduled. The checks run in this order:
video combined with audio, video, audio, images. Files and documents have no tower to ask for;
they stay the placement refusal (501 `media-batch-unsupported`), as does media on a model whose
tower the engine cannot run yet.

Inline media is capped by size too (`check_media_sizes`, run on every parsed JSON body): an
image or audio part over its cap is a 400 in the surface's shape, as OpenAI and Anthropic
answer an oversized image.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from modelhost.inference.contracts import InvalidRequest, RequestError

IMAGE_PARTS = frozenset({"image_url", "image", "input_image"})
AUDIO_PARTS = frozenset({"input_audio", "audio", "audio_url"})
VIDEO_PARTS = frozenset({"video_url", "video", "input_video"})
FILE_PARTS = frozenset({"file", "input_file", "document"})
MEDIA_PARTS = IMAGE_PARTS | AUDIO_PARTS | VIDEO_PARTS | FILE_PARTS

NO_VISION = "model has no vision sidecar"
VIDEO_WITH_AUDIO = "video and audio content parts cannot be combined"


def no_audio_tower(model_id: str) -> str:
    return (
        f"model {model_id} has no audio tower — audio input needs a model whose config.json "
        "carries audio_config and whose sidecar ships the audio tensors (e.g. gemma-4 e4b OptiQ)"
    )


def no_video(model_id: str) -> str:
    return (
        f"model {model_id} does not accept video input — video content parts need a "
        "Qwen3.5-family model (e.g. Qwen3.8-27B)"
    )


def media_kinds(part_type: object) -> frozenset[str]:
    """The kind of one part type ("image", "audio", "video" or "file"), as a set to union."""
    for kind, types in (
        ("image", IMAGE_PARTS),
        ("audio", AUDIO_PARTS),
        ("video", VIDEO_PARTS),
        ("file", FILE_PARTS),
    ):
        if part_type in types:
            return frozenset({kind})
    return frozenset()


def check_media(
    media: Iterable[str],
    model_id: str,
    *,
    vision: bool,
    audio: bool = False,
    video: bool = False,
    param: str | None = None,
) -> None:
    """Raise the 400 for media this model has no tower for; nothing when it has them all."""
    kinds = set(media)
    if "video" in kinds and "audio" in kinds:
        raise InvalidRequest(VIDEO_WITH_AUDIO, param=param)
    if "video" in kinds and not video:
        raise InvalidRequest(no_video(model_id), param=param)
    if "audio" in kinds and not audio:
        raise InvalidRequest(no_audio_tower(model_id), param=param)
    if "image" in kinds and not vision:
        raise InvalidRequest(NO_VISION, param=param)


# ---------------------------------------------------------------------------------------------
# Size caps

MiB = 1024 * 1024
DEFAULT_MAX_IMAGE_BYTES = 20 * MiB  # OpenAI's and most peers' per-image limit
DEFAULT_MAX_AUDIO_BYTES = 25 * MiB  # OpenAI's audio upload limit


def inline_media_bytes(part: Mapping[str, Any]) -> int:
    """The decoded bytes a media part carries inline: base64 data URLs and base64 `data`
    fields anywhere inside it (OpenAI's `image_url.url` and `input_audio.data`, Anthropic's
    `source.data`, Responses' `image_url`). URLs to fetch and file ids count nothing."""
    total = 0
    pending: list[tuple[str, Any]] = [("", part)]
    while pending:
        key, value = pending.pop()
        if isinstance(value, dict):
            pending.extend(value.items())
        elif isinstance(value, list):
            pending.extend((key, item) for item in value)
        elif isinstance(value, str):
            if value.startswith("data:"):
                header, _, payload = value.partition(",")
                total += _base64_bytes(payload) if header.endswith(";base64") else len(payload)
            elif key == "data":
                total += _base64_bytes(value)
    return total


def _base64_bytes(text: str) -> int:
    return len(text) * 3 // 4


def check_media_sizes(body: Any, *, max_image_bytes: int, max_audio_bytes: int) -> None:
    """Raise a 400 (`image_too_large`, `audio_too_large`) for an inline image or audio part
    over its cap, wherever in `body` it sits; the message names both sizes."""
    pending = [body]
    while pending:
        value = pending.pop()
        if isinstance(value, list):
            pending.extend(item for item in value if isinstance(item, list | dict))
            continue
        if not isinstance(value, dict):
            continue
        pictures = value.get("images")  # Ollama's: a message's or a prompt's base64 strings
        if isinstance(pictures, list):
            for picture in pictures:
                if isinstance(picture, str):
                    _check_size("image", _base64_bytes(picture), max_image_bytes)
        kind = value.get("type")
        if isinstance(kind, str) and (kind in IMAGE_PARTS or kind in AUDIO_PARTS):
            what = "image" if kind in IMAGE_PARTS else "audio"
            limit = max_image_bytes if what == "image" else max_audio_bytes
            _check_size(what, inline_media_bytes(value), limit)
            continue
        pending.extend(item for item in value.values() if isinstance(item, list | dict))


def _check_size(what: str, size: int, limit: int) -> None:
    if size > limit:
        message = f"{what} content part is {size / MiB:.1f} MiB; the limit is {limit / MiB:.1f} MiB"
        error = {"type": "invalid_request_error", "code": f"{what}_too_large"}
        raise RequestError(400, message, error)
