"""Media content parts: which kind each part type is, and the 400 for a model that cannot take it.

Every surface records the kinds of media its request carries (`InferenceRequest.media`), so no
part is ever silently dropped: a model without the tower a kind needs refuses it with a 400 in
the surface's own error shape, before anything is scheduled. The checks run in this order:
video combined with audio, video, audio, images. Files and documents have no tower to ask for;
they stay the placement refusal (501 `media-batch-unsupported`), as does media on a model whose
tower the engine cannot run yet.
"""

from __future__ import annotations

from collections.abc import Iterable

from modelhost.inference.contracts import InvalidRequest

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
