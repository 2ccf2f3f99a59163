"""Flattening a message's content, written once for every surface: a string, or a list of typed
parts whose text joins into the one string a chat template reads, and whose media parts only
record the kinds of media the request carries (`inference.media`).

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
from modelhost.inference.media import MEDIA_PARTS, media_kinds

# A handler for one part type: the part and where it is (`messages[0].content[1]`), and the
# text it adds to the content (None: none).
PartHandler = Callable[[Mapping[str, Any], str], str | None]


@dataclass(frozen=True, slots=True)
class FlatContent:
    texts: tuple[str, ...]
    media: frozenset[str]  # kinds of media parts: image, audio, video, file

    @property
    def text(self) -> str:
        return "\n".join(self.texts)


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
    media: frozenset[str] = frozenset()
    for number, part in enumerate(content):
        at = f"{where}.content[{number}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in text_types:
            texts.append(part_text(part, at, param))
        elif kind in MEDIA_PARTS:
            media = media | media_kinds(kind)
        elif others is not None and isinstance(kind, str) and kind in others:
            text = others[kind](part, at)
            if text is not None:
                texts.append(text)
        else:
            raise InvalidRequest(f"{at} has an unsupported type {kind!r}", param=param)
    return FlatContent(tuple(texts), media)


def part_text(part: Mapping[str, Any], where: str, param: str) -> str:
    """A text part's `text`; a 400 when it is not a string."""
    text = part.get("text")
    if not isinstance(text, str):
        raise InvalidRequest(f"{where}.text must be of type str", param=param)
    return text
