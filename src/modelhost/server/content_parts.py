"""Flattening a message's content, written once for every surface: a string, or a list of typed
parts whose text joins into the one string a chat template reads. Image parts are kept, in
order (`inference.images.ImagePart`: where each was and its data, decoded later by the stage);
every media part records its kind (`inference.media`), so none is dropped unseen.

With images, the content a template reads is a list: `{"type": "text", "text": ...}` and
`{"type": "image"}` where each image was, the shape the vision models' Hugging Face templates
(Idefics3, Gemma 3, Qwen2.5-VL) iterate.

The surfaces differ in a few switches: which part types carry text, what their parts are
called in errors ("content parts", "content blocks"), which request field a 400 names, whether
an absent content is empty, and what their other part types do (Anthropic's `tool_use` and
`thinking`, the Responses API's `refusal`): each of those gets a handler, which returns text to
join or None.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from modelhost.inference.contracts import InvalidRequest
from modelhost.inference.images import ImagePart
from modelhost.inference.media import IMAGE_PARTS, MEDIA_PARTS, media_kinds

# A handler for one part type: the part and where it is (`messages[0].content[1]`), and the
# text it adds to the content (None: none).
PartHandler = Callable[[Mapping[str, Any], str], str | None]


@dataclass(frozen=True, slots=True)
class FlatContent:
    texts: tuple[str, ...]
    media: frozenset[str]  # kinds of media parts: image, audio, video, file
    pieces: tuple[str | ImagePart, ...] = ()  # texts and images in order (with images)

    @property
    def text(self) -> str:
        return "\n".join(self.texts)

    @property
    def images(self) -> tuple[ImagePart, ...]:
        return tuple(piece for piece in self.pieces if isinstance(piece, ImagePart))

    def template_content(self) -> str | list[dict[str, Any]]:
        """What a chat template reads: the text, or with images the text and image parts."""
        if not self.images:
            return self.text
        return [
            {"type": "image"} if isinstance(piece, ImagePart) else {"type": "text", "text": piece}
            for piece in self.pieces
        ]


def require_role(role: Any, roles: Collection[str], where: str, param: str) -> str:
    """A message's `role`, one the surface takes (else a 400 naming them, in its order)."""
    if role not in roles:
        allowed = ", ".join(f"'{r}'" for r in roles)
        raise InvalidRequest(f"{where}.role must be one of {allowed}", param=param)
    return str(role)


def flatten_content(
    content: Any,
    where: str,
    *,
    param: str,
    text_types: Collection[str] = ("text",),
    others: Mapping[str, PartHandler] | None = None,
    noun: str = "content parts",
    absent_is_empty: bool = True,
) -> FlatContent:
    """`content` (a string, or a list of parts) as its text and its kinds of media; a 400
    naming `param` for anything else, or a part of a type the surface does not take."""
    if content is None and absent_is_empty:
        return FlatContent((), frozenset())
    if isinstance(content, str):
        return FlatContent((content,), frozenset())
    if not isinstance(content, list):
        raise InvalidRequest(f"{where}.content must be a string or a list of {noun}", param=param)
    texts: list[str] = []
    pieces: list[str | ImagePart] = []
    media: frozenset[str] = frozenset()
    for number, part in enumerate(content):
        at = f"{where}.content[{number}]"
        kind = part.get("type") if isinstance(part, dict) else None
        text: str | None = None
        if kind in text_types:
            text = part_text(part, at, param)
        elif kind in IMAGE_PARTS:
            media = media | media_kinds(kind)
            pieces.append(ImagePart(at, image_source(part, at, param), param))
        elif kind in MEDIA_PARTS:
            media = media | media_kinds(kind)
        elif others is not None and isinstance(kind, str) and kind in others:
            text = others[kind](part, at)
        else:
            raise InvalidRequest(f"{at} has an unsupported type {kind!r}", param=param)
        if text is not None:
            texts.append(text)
            pieces.append(text)
    return FlatContent(tuple(texts), media, tuple(pieces))


def part_text(part: Mapping[str, Any], where: str, param: str) -> str:
    """A text part's `text`; a 400 when it is not a string."""
    text = part.get("text")
    if not isinstance(text, str):
        raise InvalidRequest(f"{where}.text must be of type str", param=param)
    return text


def image_source(part: Mapping[str, Any], where: str, param: str) -> str:
    """An image part's data as the client sent it (a data URL, base64, or a URL), from each
    surface's shape: OpenAI's `image_url.url`, the Responses API's `image_url`, Anthropic's
    `source` (base64 or url); a 400 naming the part when it has none."""
    kind = part.get("type")
    value: Any = None
    if kind == "image_url":
        value = part.get("image_url")
        value = value.get("url") if isinstance(value, dict) else value
    elif kind == "input_image":
        value = part.get("image_url")
        if value is None and part.get("file_id") is not None:
            message = f"{where}.file_id: uploaded files are not supported; send image_url"
            raise InvalidRequest(message, param=param)
    elif kind == "image":
        source = part.get("source")
        if isinstance(source, dict) and source.get("type") == "base64":
            media_type, data = source.get("media_type"), source.get("data")
            if isinstance(data, str):
                value = f"data:{media_type or 'image/png'};base64,{data}"
        elif isinstance(source, dict) and source.get("type") == "url":
            value = source.get("url")
        elif isinstance(part.get("image"), str):  # a bare string (some clients' shorthand)
            value = part.get("image")
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{where} has no image data", param=param)
    return value
