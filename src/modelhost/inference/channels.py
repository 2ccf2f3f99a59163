"""Splitting a row's text into the neutral channels: reasoning, content and tool calls.

Driven by the family record (its reasoning and tool-call dialects) and the request
(tools given or not), never by a protocol: each surface only maps the split events to its wire
shape. Reasoning is split first (a call written while thinking is not a call), then the content
goes through the tool-call parser. Both hold back partial markers, so markup never leaks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from modelhost.inference.contracts import (
    ChatPrompt,
    CompletionEvent,
    FinishReason,
    InferenceRequest,
)
from modelhost.models.families import Family
from modelhost.text.reasoning import ReasoningSplitter, prompt_opens_thinking
from modelhost.text.tool_calls import ToolCall, ToolCallParser
from modelhost.text.tool_prompt import custom_names, tool_name


class OutputChannels:
    def __init__(
        self,
        reasoning: ReasoningSplitter | None,
        tools: ToolCallParser | None,
        freeform: frozenset[str] = frozenset(),
    ) -> None:
        self._reasoning = reasoning
        self._tools = tools
        self._freeform = freeform  # custom tools' names: their calls carry raw `input`

    @classmethod
    def for_request(
        cls,
        request: InferenceRequest,
        family: Family,
        prompt_tail: Callable[[], str],
        *,
        constrained: bool = False,
    ) -> OutputChannels | None:
        """The splitter a request needs, or None when its text passes through as it is.

        `prompt_tail` renders the end of the prompt, asked only when the family has reasoning.
        `constrained`: a grammar enforces the whole answer (a schema, a forced call), so the
        model writes no reasoning and every character is the value, tag-like text included.
        """
        prompt = request.prompt
        if not isinstance(prompt, ChatPrompt):
            return None  # text completions are raw continuations
        reasoning = None
        dialect = family.reasoning
        if dialect is not None and request.thinking is not False and not constrained:
            start = prompt_opens_thinking(prompt_tail(), dialect.markers)
            reasoning = ReasoningSplitter(
                dialect.markers, start_in_thinking=start, answer=dialect.answer
            )
        tools = None
        if prompt.tools:
            names = [tool_name(tool) for tool in prompt.tools]
            extra = (family.tool_call_markers,) if family.tool_call_markers else ()
            tools = ToolCallParser(
                extra,
                tool_names=[name for name in names if name],
                python_list=family.tool_dialect.python_list,
            )
        if reasoning is None and tools is None:
            return None
        return cls(reasoning, tools, custom_names(prompt.tools))

    def apply(self, event: CompletionEvent) -> CompletionEvent:
        reasoning, content = self._split(event.text)
        if not event.is_terminal:
            return dataclasses.replace(event, text=content, reasoning=reasoning)
        if self._reasoning is not None:
            more_reasoning, more_content = self._reasoning.flush()
            reasoning += more_reasoning
            content += self._content(more_content)
        calls: tuple[ToolCall, ...] = ()
        if self._tools is not None:
            rest, calls = self._tools.finish()
            content += rest
            calls = tuple(self._as_freeform(call) for call in calls)
        finish: FinishReason | None = "tool_calls" if calls else event.finish_reason
        return dataclasses.replace(
            event, text=content, reasoning=reasoning, tool_calls=calls, finish_reason=finish
        )

    def _as_freeform(self, call: ToolCall) -> ToolCall:
        """A custom tool called as a function of `input` (templates with their own tool format
        see it that way) is the raw input it carries."""
        if call.input is not None or call.name not in self._freeform:
            return call
        raw = call.arguments_object().get("input")
        return dataclasses.replace(call, arguments="{}", input=raw if isinstance(raw, str) else "")

    def _split(self, text: str) -> tuple[str, str]:
        if self._reasoning is None:
            return "", self._content(text)
        reasoning, content = self._reasoning.push(text)
        return reasoning, self._content(content)

    def _content(self, text: str) -> str:
        if self._tools is None or not text:
            return text
        return self._tools.push(text)
