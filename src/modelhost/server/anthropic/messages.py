"""Anthropic Messages: `POST /v1/messages` (JSON and SSE) and `POST /v1/messages/count_tokens`.

Wire request → InferenceRequest (see `anthropic_wire` for the block flattening) → the stage →
a `message` object, or SSE in Anthropic's order: `message_start`, then per content block
`content_block_start`, `content_block_delta`…, `content_block_stop`, then `message_delta`
(stop_reason, usage) and `message_stop`. Keep-alives are `ping` events; an error after the
stream opened is one `error` event. `stop_reason` is `end_turn`, `max_tokens`, or
`stop_sequence` with the matched string in `stop_sequence`.

The stage splits reasoning and tool calls out of the text (by the family's markers); here they
become `thinking` blocks (first, with an empty signature) and `tool_use` blocks with
`stop_reason: "tool_use"`. A forced `tool_choice` (`any`, `tool`) and `output_config.format`
become the request's grammar. Declared tools are offered or named as not offered (tools.py).
Usage counts the prompt tokens the prefix cache served as `cache_read_input_tokens`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from modelhost.inference.contracts import (
    ChatPrompt,
    CompletionEvent,
    FinishReason,
    InferenceRequest,
    InferenceResult,
    SamplingRequest,
    Usage,
)
from modelhost.inference.image_prompt import build_prompt
from modelhost.inference.media import check_media
from modelhost.server.anthropic import tools as anthropic_tools
from modelhost.server.anthropic import wire
from modelhost.server.exchange import Prepared, Reply, answer_inference, answer_json
from modelhost.server.http import EventStreamResponse, RequestLog, serving_stage
from modelhost.server.openai import fields
from modelhost.server.sse_frames import TextFrames, named_event

if TYPE_CHECKING:
    from modelhost.inference.stage import AdmittedRequest, InferenceStage

ROUTE = "POST /v1/messages"
COUNT_ROUTE = "POST /v1/messages/count_tokens"


async def create_message(request: Request) -> Response | EventStreamResponse:
    log = RequestLog(wire.new_message_id(), ROUTE)
    return await answer_inference(
        request,
        log,
        wire.anthropic_error,
        lambda body: prepare_message(body, log.request_id),
        heartbeat=wire.PING,
    )


def prepare_message(body: dict[str, Any], request_id: str) -> Prepared:
    inference = parse_messages_request(body, request_id)
    not_offered = anthropic_tools.read_tools(body).not_offered

    def reply(stage: InferenceStage, admitted: AdmittedRequest) -> Reply:
        meta = {"id": request_id, "model": admitted.model_id}
        return Reply(
            lambda result: message_json(meta, result),
            lambda: MessageStream(meta, admitted.prompt_tokens),
        )

    return Prepared(inference, reply, not_offered)


async def count_tokens(request: Request) -> Response:
    """`{input_tokens}`: the prompt the same body would send, through the same template."""
    log = RequestLog(wire.new_message_id(), COUNT_ROUTE)

    async def count(body: dict[str, Any]) -> dict[str, Any]:
        inference = parse_messages_request(body, log.request_id, count_only=True)
        stage = serving_stage(request, body.get("model"))
        return {"input_tokens": await asyncio.to_thread(_prompt_tokens, stage, inference)}

    return await answer_json(request, log, wire.anthropic_error, count)


def _prompt_tokens(stage: InferenceStage, inference: InferenceRequest) -> int:
    model = stage.model
    check_media(inference.media, model.id, vision=model.vision is not None)
    built = build_prompt(model, inference, limits=stage.image_limits)
    return len(built.ids)  # an image counts its placeholder tokens


# ---------------------------------------------------------------------------------------------
# Request


def parse_messages_request(
    body: dict[str, Any], request_id: str, *, count_only: bool = False
) -> InferenceRequest:
    """The neutral request for a Messages body; `count_only` skips the generation fields."""
    messages, media, images = wire.template_messages(body)
    tools = anthropic_tools.read_tools(body)
    prompt = ChatPrompt(messages=tuple(messages), tools=tools.offered)
    if count_only:
        return InferenceRequest(
            request_id=request_id,
            method="chat",
            prompt=prompt,
            thinking=wire.thinking(body),
            has_media=bool(media),
            media=media,
            images=images,
        )
    top_k = fields.number(body, "top_k", int, at_least=-1)
    grammar, instruction = wire.output_format(body)
    forced = anthropic_tools.forced_tool(body, tools)
    if forced is not None:  # a forced call outranks the output format
        grammar, instruction = forced
    return InferenceRequest(
        request_id=request_id,
        method="chat",
        prompt=prompt,
        sampling=SamplingRequest(
            temperature=fields.number(body, "temperature", at_least=0),
            top_p=fields.number(body, "top_p", at_least=0, at_most=1),
            top_k=None if top_k == -1 else top_k,
            min_p=fields.number(body, "min_p", at_least=0, at_most=1),
            repetition_penalty=fields.number(body, "repetition_penalty", above=0),
            presence_penalty=fields.number(body, "presence_penalty", at_least=-2, at_most=2),
            frequency_penalty=fields.number(body, "frequency_penalty", at_least=-2, at_most=2),
            seed=fields.field(body, "seed", int),
            speculate=fields.field(body, "speculate", bool),
        ),
        max_tokens=fields.number(body, "max_tokens", int, at_least=1),
        stop=wire.stop_sequences(body),
        stream=bool(fields.field(body, "stream", bool)),
        thinking=wire.thinking(body),
        has_media=bool(media),
        media=media,
        images=images,
        structured_output=instruction,
        grammar=grammar,
    )


# ---------------------------------------------------------------------------------------------
# Response


def stop_reason(finish_reason: FinishReason, stop_sequence: str | None) -> str:
    if finish_reason == "tool_calls":  # a call parsed before the stop string still is a call
        return "tool_use"
    if stop_sequence is not None:
        return "stop_sequence"
    return {"length": "max_tokens", "tool_calls": "tool_use"}.get(finish_reason, "end_turn")


def usage_json(usage: Usage) -> dict[str, Any]:
    """Anthropic counts cache reads apart from `input_tokens`, so the three add up to the prompt:
    `cache_read_input_tokens` are the prompt tokens the prefix cache served; writing to the
    cache costs nothing extra here and needs no `cache_control` (every full block is kept), so
    `cache_creation_input_tokens` is 0 and the tokens not read count as `input_tokens`."""
    out: dict[str, Any] = {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": usage.cached_tokens,
    }
    predictions = usage.prediction_details()
    if predictions:  # speculation's guesses, named as OpenAI's usage names them (SDKs keep extras)
        out["output_tokens_details"] = predictions
    return out


def message_json(meta: Mapping[str, Any], result: InferenceResult) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if result.reasoning:
        content.append({"type": "thinking", "thinking": result.reasoning, "signature": ""})
    if result.text or not (result.tool_calls or result.reasoning):
        content.append({"type": "text", "text": result.text})
    for call in result.tool_calls:
        content.append(
            {"type": "tool_use", "id": call.id, "name": call.name, "input": call.arguments_object()}
        )
    reason = stop_reason(result.finish_reason, result.stop_sequence)
    return {
        **meta,
        "type": "message",
        "role": "assistant",
        "content": content,
        "stop_reason": reason,
        "stop_sequence": _stop_sequence(reason, result),
        "usage": usage_json(result.usage),
    }


class MessageStream:
    """The SSE events of one streamed message: a thinking block first when the model reasons,
    then a text block (opened at the first text), then one complete block per tool call."""

    def __init__(self, meta: Mapping[str, Any], prompt_tokens: int) -> None:
        self.meta = meta
        self.prompt_tokens = prompt_tokens
        self.index = -1  # the current block's index
        self.open: str | None = None  # the current block's type, while it is open
        self._deltas: TextFrames | None = None  # the open text or thinking block's deltas

    def start(self) -> list[str]:
        message = {
            **self.meta,
            "type": "message",
            "role": "assistant",
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0},
        }
        return [named_event("message_start", {"message": message})]

    def delta(self, event: CompletionEvent) -> list[str]:
        frames: list[str] = []
        if event.reasoning:
            frames += self._text_block("thinking")
            frames.append(self._text_delta(event.reasoning))
        if event.text:
            frames += self._text_block("text")
            frames.append(self._text_delta(event.text))
        return frames

    def _text_block(self, kind: str) -> list[str]:
        """Open a `kind` block ("text" or "thinking") unless it is open, with its deltas."""
        frames = self._block({"type": kind, kind: ""})
        if frames:
            delta = f"{kind}_delta"
            self._deltas = TextFrames(lambda text: self._delta({"type": delta, kind: text}))
        return frames

    def _text_delta(self, text: str) -> str:
        assert self._deltas is not None
        return self._deltas(text)

    def finish(self, event: CompletionEvent) -> list[str]:
        assert event.usage is not None and event.finish_reason is not None
        frames = self.delta(event)
        if self.index == -1 and not event.tool_calls:
            frames += self._block({"type": "text", "text": ""})  # an empty answer: one empty block
        frames += self._close()
        for call in event.tool_calls:
            block = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
            frames += self._block(block)
            frames.append(self._delta({"type": "input_json_delta", "partial_json": call.arguments}))
            frames += self._close()
        reason = stop_reason(event.finish_reason, event.stop_sequence)
        delta = {"stop_reason": reason, "stop_sequence": _stop_sequence(reason, event)}
        usage = usage_json(event.usage)
        frames.append(named_event("message_delta", {"delta": delta, "usage": usage}))
        frames.append(named_event("message_stop", {}))
        return frames

    def error(self, status: int, body: Mapping[str, Any]) -> list[str]:
        return [wire.anthropic_stream_error(status, body)]

    def _block(self, block: Mapping[str, Any]) -> list[str]:
        """Open a block of `block`'s type unless one is open already (closing another one)."""
        if self.open == block["type"]:
            return []
        frames = self._close()
        self.index += 1
        self.open = str(block["type"])
        payload = {"index": self.index, "content_block": dict(block)}
        return [*frames, named_event("content_block_start", payload)]

    def _delta(self, delta: Mapping[str, Any]) -> str:
        return named_event("content_block_delta", {"index": self.index, "delta": dict(delta)})

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        frames = []
        if self.open == "thinking":  # clients replay thinking with its signature; ours is empty
            frames.append(self._delta({"type": "signature_delta", "signature": ""}))
        self.open = None
        return [*frames, named_event("content_block_stop", {"index": self.index})]


def _stop_sequence(reason: str, result: CompletionEvent | InferenceResult) -> str | None:
    return result.stop_sequence if reason == "stop_sequence" else None
