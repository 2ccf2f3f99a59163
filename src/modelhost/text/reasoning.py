"""Reasoning split out of generated text by the family's tags (`<think>`…`</think>`), streaming.

Deltas can split a tag anywhere, so a tail that may be the start of the next tag is held back
(as the stop matcher does) and tags never reach either channel. A prompt that already opened the
thinking block (templates that put `<think>` in the generation prompt) starts inside it, so the
model's first text is reasoning until it closes the tag.

Some families wrap the answer after the reasoning in tags of its own (Granite 3.3:
`<think>…</think><response>…</response>`): those `answer` tags are dropped from the content the
same way, held back while they may be forming.
"""

from __future__ import annotations


class ReasoningSplitter:
    def __init__(
        self,
        markers: tuple[str, str],
        *,
        start_in_thinking: bool = False,
        answer: tuple[str, str] | None = None,
    ) -> None:
        self._open, self._close = markers
        self._answer_tags = answer or ()
        self._thinking = start_in_thinking
        self._pending = ""
        self._content_started = False  # the blank lines after `</think>` are not content
        self._reasoning_started = False

    @property
    def thinking(self) -> bool:
        return self._thinking

    def push(self, text: str) -> tuple[str, str]:
        """Take a delta; return (reasoning, content) safe to show now."""
        pending = self._pending + text
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            found = _first_tag(pending, self._tags())
            if found is None:
                break
            index, tag = found
            self._emit(pending[:index], reasoning, content)
            pending = pending[index + len(tag) :]
            if tag in (self._open, self._close):  # an answer tag is only dropped
                self._thinking = not self._thinking
        held = max(_held_length(pending, tag) for tag in self._tags())
        self._pending = pending[len(pending) - held :]
        self._emit(pending[: len(pending) - held], reasoning, content)
        return "".join(reasoning), "".join(content)

    def flush(self) -> tuple[str, str]:
        """At the end: the held-back tail, in the channel it was headed for."""
        pending, self._pending = self._pending, ""
        reasoning: list[str] = []
        content: list[str] = []
        self._emit(pending, reasoning, content)
        return "".join(reasoning), "".join(content)

    def _tags(self) -> tuple[str, ...]:
        """The tags that may come next: the one that switches channel, and in the content the
        answer's own tags."""
        if self._thinking:
            return (self._close,)
        return (self._open, *self._answer_tags)

    def _emit(self, text: str, reasoning: list[str], content: list[str]) -> None:
        if self._thinking:
            if not self._reasoning_started:
                text = text.lstrip("\n")
                self._reasoning_started = bool(text)
            reasoning.append(text)
        else:
            if not self._content_started:
                text = text.lstrip()
                self._content_started = bool(text)
            content.append(text)


def _first_tag(text: str, tags: tuple[str, ...]) -> tuple[int, str] | None:
    """The earliest of `tags` in `text`, as (index, tag)."""
    found = [(index, tag) for tag in tags if (index := text.find(tag)) != -1]
    return min(found) if found else None


def _held_length(pending: str, tag: str) -> int:
    for length in range(min(len(pending), len(tag) - 1), 0, -1):
        if tag.startswith(pending[-length:]):
            return length
    return 0


def prompt_opens_thinking(prompt_tail: str, markers: tuple[str, str]) -> bool:
    """Whether a rendered prompt ends inside an unclosed thinking block."""
    opened = prompt_tail.rfind(markers[0])
    return opened != -1 and prompt_tail.find(markers[1], opened) == -1
