"""Ollama's generation routes: `POST /api/chat` and `POST /api/generate`.

Wire request → InferenceRequest (see `wire` for options, format, think, images, tools) → the
stage → one JSON object (`stream: false`), or NDJSON by default: one line per text delta and a
final line with `done: true`, `done_reason` and the counts and durations in nanoseconds. Tool
calls come parsed (arguments as an object) on a line of their own before the final one.

A request with nothing to generate (no messages, an empty prompt) only loads the model (or,
with `keep_alive: 0`, lets it go) and answers `done_reason: "load"` (or `"unload"`) at once; the
front applies `keep_alive` itself (`surfaces.Route.keep_alive`).

A prompt too long for the context window is trimmed to fit, as Ollama trims it (the oldest
messages go, system messages stay; `generate`'s own prompt keeps its end), and
`prompt_eval_count` counts what was kept; `"truncate": false` makes it a 400 naming both sizes.

`generate` honours `prompt`, `system`, `raw` (the prompt as it is, without the template) and
`images`; a custom `template`, a `suffix` (fill-in-the-middle: no family here declares it) and
a `context` from an older API are refused with a 400 that says so, as are the image
generation fields (`width`, `height`, `steps`): no model here draws.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from modelhost.inference.contracts import (
    ChatPrompt,
    CompletionEvent,
    ImagePart,
    InferenceRequest,
    InferenceResult,
    InvalidRequest,
    Overflow,
    TextPrompt,
    Usage,
)
from modelhost.server.exchange import Prepared, Reply, answer_inference
from modelhost.server.http import (
    STAGE_KEY,
    EventStreamResponse,
    RequestLog,
    error_response,
    front_waited_s,
    read_json_object,
    serving_stage,
)
from modelhost.server.ollama import wire
from modelhost.server.openai import fields
from modelhost.server.sse_frames import TextFrames

if TYPE_CHECKING:
    from modelhost.inference.stage import AdmittedRequest, InferenceStage

CHAT_ROUTE = "POST /api/chat"
GENERATE_ROUTE = "POST /api/generate"
NS = 1_000_000_000
IMAGE_GENERATION = ("width", "height", "steps")  # Ollama's experimental image models' fields


async def create_chat(request: Request) -> Response | EventStreamResponse:
    return await _answer(request, CHAT_ROUTE, "chat")


async def create_generation(request: Request) -> Response | EventStreamResponse:
    return await _answer(request, GENERATE_ROUTE, "generate")


async def _answer(request: Request, route: str, kind: str) -> Response | EventStreamResponse:
    log = RequestLog(wire.new_id(), route)
    try:
        body = await read_json_object(request)
        stage = serving_stage(request, None)
        check_name(request, body.get("model"), stage.model_id)
        nothing = _nothing_to_generate(body, kind)
        if nothing:
            log.finish(200)
            return JSONResponse(_load_reply(body, kind))
        _check_capabilities(body, kind, stage)
    except Exception as exc:
        return error_response(exc, log.request_id, wire.ollama_error, log)
    parse = parse_chat if kind == "chat" else parse_generate
    return await answer_inference(
        request,
        log,
        wire.ollama_error,
        lambda body: _prepared(
            parse(body, log.request_id), body, kind, log, front_waited_s(request)
        ),
        heartbeat=wire.HEARTBEAT,
        content_type=wire.NDJSON,
    )


def check_name(request: Request, named: Any, served: str) -> None:
    """A 404 for a name this server does not serve. With a router the front has already
    resolved it; a worker is only sent what its front resolved; a server of one model checks
    it here."""
    app = request.app.state
    routed = getattr(app, "router", None) is not None or STAGE_KEY in request.scope
    if not routed and app.settings.owner != "worker":
        wire.local_id(named, lambda model_id: model_id == served)


def _nothing_to_generate(body: dict[str, Any], kind: str) -> bool:
    if kind == "chat":
        return body.get("messages") in (None, [])
    return body.get("prompt") in (None, "") and not body.get("suffix")


def _load_reply(body: dict[str, Any], kind: str) -> dict[str, Any]:
    """A request with nothing to generate loads its model, or lets it go with keep_alive 0."""
    reason = "unload" if wire.keep_alive(body) == 0 else "load"
    reply: dict[str, Any] = {"model": body.get("model"), "created_at": wire.created_at()}
    if kind == "chat":
        reply["message"] = {"role": "assistant", "content": ""}
    else:
        reply["response"] = ""
    return {**reply, "done": True, "done_reason": reason}


def _check_capabilities(body: dict[str, Any], kind: str, stage: InferenceStage) -> None:
    """What the model cannot do, refused before anything runs, in Ollama's words."""
    card = stage.card()
    name = body.get("model") or card.id
    thinking, _ = wire.think(body)
    if thinking and not card.reasoning:
        raise InvalidRequest(f'"{name}" does not support thinking', param="think")
    if wire.tools(body) and not card.tools:
        raise InvalidRequest(f'"{name}" does not support tools', param="tools")
    messages = body.get("messages")
    pictures = bool(body.get("images")) or any(
        isinstance(m, dict) and m.get("images")
        for m in (messages if isinstance(messages, list) else [])
    )
    if pictures and not card.vision:
        message = f'"{name}" does not support images: it has no vision encoder'
        raise InvalidRequest(message, param="images")


# ---------------------------------------------------------------------------------------------
# Requests


def parse_chat(body: dict[str, Any], request_id: str) -> InferenceRequest:
    messages, media, shown = wire.template_messages(body.get("messages"))
    thinking, template_kwargs = wire.think(body)
    return _request(
        body,
        request_id,
        ChatPrompt(tuple(messages), wire.tools(body), template_kwargs),
        thinking=thinking,
        media=media,
        images=shown,
    )


def parse_generate(body: dict[str, Any], request_id: str) -> InferenceRequest:
    if body.get("template"):
        message = "template is not supported: the model's own chat template is used (or raw)"
        raise InvalidRequest(message, param="template")
    if body.get("suffix"):
        message = f'"{body.get("model")}" does not support insert'
        raise InvalidRequest(message, param="suffix")
    if body.get("context"):
        raise InvalidRequest("context is not supported: send the conversation", param="context")
    drawn = [key for key in IMAGE_GENERATION if body.get(key) is not None]
    if drawn:
        message = f'"{body.get("model")}" does not generate images ({", ".join(drawn)})'
        raise InvalidRequest(message, param=drawn[0])
    prompt = fields.field(body, "prompt", str) or ""
    system = fields.field(body, "system", str)
    pictures = wire.images(body.get("images"), "images")
    media = frozenset({"image"}) if pictures else frozenset()
    thinking, template_kwargs = wire.think(body)
    if fields.field(body, "raw", bool):
        if pictures:
            raise InvalidRequest("images need the template: not with raw", param="images")
        return _request(body, request_id, TextPrompt(prompt), thinking=None, media=media)
    messages: list[dict[str, Any]] = []
    if system:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": wire.with_images(prompt, pictures)})
    chat = ChatPrompt(tuple(messages), None, template_kwargs)
    shown = wire.image_parts(pictures, "images")
    return _request(body, request_id, chat, thinking=thinking, media=media, images=shown)


def _request(
    body: dict[str, Any],
    request_id: str,
    prompt: ChatPrompt | TextPrompt,
    *,
    thinking: bool | None,
    media: frozenset[str],
    images: tuple[ImagePart, ...] = (),
) -> InferenceRequest:
    opts = wire.options(body)
    wire.num_ctx(opts)
    wire.keep_alive(body)  # validated here; the front applies it
    grammar, instruction = wire.output_format(body)
    stream = fields.field(body, "stream", bool)
    return InferenceRequest(
        request_id=request_id,
        method="chat" if isinstance(prompt, ChatPrompt) else "text",
        prompt=prompt,
        sampling=wire.sampling(opts),
        max_tokens=wire.max_tokens(opts),
        max_tokens_field="num_predict",
        stop=wire.stop(opts),
        logprobs=wire.logprobs(body),
        stream=stream is not False,  # Ollama streams unless told not to
        thinking=thinking,
        has_media=bool(media),
        media=media,
        images=images,
        structured_output=instruction,
        grammar=grammar,
        overflow=overflow(body),
    )


def overflow(body: dict[str, Any]) -> Overflow:
    """Ollama trims a prompt too long for the window (the oldest messages go, system messages
    stay) unless the request says `"truncate": false`: then it is an error."""
    return "error" if fields.field(body, "truncate", bool) is False else "truncate"


# ---------------------------------------------------------------------------------------------
# Replies


@dataclass(frozen=True, slots=True)
class Clock:
    """When this request arrived, was admitted and saw its first token (monotonic seconds)."""

    log: RequestLog
    admitted: AdmittedRequest
    front_waited_s: float = 0.0  # a worker's: what its front spent leasing before it came

    def durations(self, usage: Usage) -> dict[str, int]:
        now = time.monotonic()
        arrived, admitted = self.log.started_at, self.admitted.arrived_at
        first = self.admitted.first_token_at or now
        waited = self.front_waited_s
        return {
            "total_duration": _ns(now - arrived + waited),
            "load_duration": _ns(admitted - arrived + waited),  # leasing (a load) and waiting
            "prompt_eval_count": usage.prompt_tokens,
            "prompt_eval_duration": _ns(first - admitted),
            "eval_count": usage.completion_tokens,
            "eval_duration": _ns(now - first),
        }


def _ns(seconds: float) -> int:
    return max(0, int(seconds * NS))


def _prepared(
    inference: InferenceRequest, body: dict[str, Any], kind: str, log: RequestLog, waited: float
) -> Prepared:
    def reply(stage: InferenceStage, admitted: AdmittedRequest) -> Reply:
        model = body.get("model") or stage.model_id
        clock = Clock(log, admitted, waited)
        return Reply(
            lambda result: reply_json(kind, model, result, clock),
            lambda: OllamaLines(kind, model, clock),
        )

    return Prepared(inference, reply)


def done_reason(finish_reason: str) -> str:
    return "length" if finish_reason == "length" else "stop"


def reply_json(kind: str, model: str, result: InferenceResult, clock: Clock) -> dict[str, Any]:
    out: dict[str, Any] = {"model": model, "created_at": wire.created_at()}
    if kind == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": result.text}
        if result.reasoning:
            message["thinking"] = result.reasoning
        if result.tool_calls:
            message["tool_calls"] = wire.tool_calls_json(result.tool_calls)
        out["message"] = message
    else:
        out["response"] = result.text
        if result.reasoning:
            out["thinking"] = result.reasoning
    if result.logprobs is not None:
        out["logprobs"] = wire.logprobs_json(result.logprobs)
    out.update(done=True, done_reason=done_reason(result.finish_reason))
    return {**out, **clock.durations(result.usage)}


class OllamaLines:
    """The NDJSON lines of one streamed answer: a line per delta, then the final line."""

    def __init__(self, kind: str, model: str, clock: Clock) -> None:
        self.kind = kind
        self.clock = clock
        self.head = {"model": model, "created_at": wire.created_at()}
        self._text = TextFrames(lambda text: wire.line(self._delta("content", text)))
        self._thinking = TextFrames(lambda text: wire.line(self._delta("thinking", text)))

    def _delta(self, field: str, text: str, **extra: Any) -> dict[str, Any]:
        if self.kind == "chat":
            message = {"role": "assistant", "content": "", field: text, **extra}
            return {**self.head, "message": message, "done": False}
        return {**self.head, "response": "", ("response" if field == "content" else field): text,
                "done": False}  # fmt: skip

    def start(self) -> list[str]:
        return []

    def delta(self, event: CompletionEvent) -> list[str]:
        lines = []
        if event.reasoning:
            lines.append(self._thinking(event.reasoning))
        if event.logprobs:  # asked for: the text's line carries its tokens' log probabilities
            logprobs = wire.logprobs_json(event.logprobs)
            lines.append(wire.line({**self._delta("content", event.text), "logprobs": logprobs}))
        elif event.text:
            lines.append(self._text(event.text))
        return lines

    def finish(self, event: CompletionEvent) -> list[str]:
        assert event.usage is not None and event.finish_reason is not None
        lines = self.delta(event)
        if event.tool_calls:
            calls = wire.tool_calls_json(event.tool_calls)
            if self.kind == "chat":
                message = {"role": "assistant", "content": "", "tool_calls": calls}
                lines.append(wire.line({**self.head, "message": message, "done": False}))
        final: dict[str, Any] = {**self.head}
        if self.kind == "chat":
            final["message"] = {"role": "assistant", "content": ""}
        else:
            final["response"] = ""
        final.update(done=True, done_reason=done_reason(event.finish_reason))
        return [*lines, wire.line({**final, **self.clock.durations(event.usage)})]

    def error(self, status: int, body: Mapping[str, Any]) -> list[str]:
        return [wire.ollama_stream_error(status, body)]
