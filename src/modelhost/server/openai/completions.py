"""OpenAI text completions: `POST /v1/completions`, JSON and SSE.

The prompt is a non-empty string, tokenized as it is with no template, or an array of token ids
(clients that tokenize for themselves send them, as to OpenAI, vLLM and llama-server), prefilled
as they are: an id outside the model's vocabulary is a 400. An array holding one such prompt is
that prompt; several prompts in one request are a 501, as `n` above 1 is. Sampling, stop and
max-token fields are chat's.
`logprobs` is the legacy integer (0..5 alternatives; `true` means 0), answered in the legacy
`{tokens, token_logprobs, top_logprobs, text_offset}` shape OpenAI clients read.
`echo: true` puts the prompt in front of the text; with `logprobs` its tokens come first in
the logprobs too, scored by the model (the first has nothing before it: null), which is
what perplexity tools read.

SSE: text chunks, a terminal chunk with `finish_reason` (and `usage`), then `[DONE]`;
`stream_options.include_usage` works as in chat.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from modelhost.inference.contracts import (
    CompletionEvent,
    InferenceRequest,
    InferenceResult,
    InvalidRequest,
    Prompt,
    TextPrompt,
    TokenLogprob,
    TokenPrompt,
)
from modelhost.server.exchange import Prepared, Reply, answer_inference
from modelhost.server.http import EventStreamResponse, RequestLog
from modelhost.server.openai import fields
from modelhost.server.openai.wire import (
    DONE,
    completion_error,
    completion_stream_error,
    new_id,
    sse,
    text_logprobs_json,
    usage_json,
)
from modelhost.server.sse_frames import TextFrames

if TYPE_CHECKING:
    from modelhost.inference.stage import AdmittedRequest, InferenceStage

ROUTE = "POST /v1/completions"
MAX_LOGPROBS = 5
PROMPT_REQUIRED = "prompt (a non-empty string, or a non-empty array of token ids) is required"


async def create_completion(request: Request) -> Response | EventStreamResponse:
    log = RequestLog(new_id("cmpl"), ROUTE)
    return await answer_inference(
        request, log, completion_error, lambda body: prepare_completion(body, log.request_id)
    )


def prepare_completion(body: dict[str, Any], request_id: str) -> Prepared:
    inference, options = parse_completion_request(body, request_id)

    def reply(stage: InferenceStage, admitted: AdmittedRequest) -> Reply:
        meta = {"id": request_id, "created": int(time.time()), "model": admitted.model_id}
        echo = echo_text(inference.prompt, stage) if body.get("echo") is True else None
        return Reply(
            lambda result: text_completion_json(meta, result, echo),
            lambda: TextStream(meta, options.include_usage, admitted.want_logprobs, echo),
        )

    return Prepared(inference, reply)


def parse_completion_request(
    body: dict[str, Any], request_id: str
) -> tuple[InferenceRequest, fields.StreamOptions]:
    prompt, num_prompts = parse_prompt(body.get("prompt"))
    options = fields.stream_options(body)
    grammar, structured_output = fields.structured_output(body)
    echo = fields.field(body, "echo", bool) is True
    logprobs = text_logprobs(body)
    inference = InferenceRequest(
        request_id=request_id,
        method="text",
        prompt=prompt,
        sampling=fields.sampling(body),
        max_tokens=fields.max_tokens(body),
        max_tokens_field=fields.max_tokens_field(body),
        stop=fields.stop(body),
        ignore_eos=bool(fields.field(body, "ignore_eos", bool)),
        logprobs=logprobs,
        prompt_logprobs=echo and logprobs is not None,
        stream=options.stream,
        num_choices=fields.choices(body),
        num_prompts=num_prompts,
        structured_output=structured_output,
        grammar=grammar,
    )
    return inference, options


def parse_prompt(value: Any) -> tuple[TextPrompt | TokenPrompt, int]:
    """The (first) prompt, and how many the request holds: a string, an array of token ids,
    or an array of those."""
    prompts = value if isinstance(value, list) and value and not _is_token_ids(value) else [value]
    field = "prompt[0]" if prompts is value else "prompt"
    first = prompts[0]
    if isinstance(first, str) and first:
        return TextPrompt(first), len(prompts)
    if _is_token_ids(first):
        return TokenPrompt(tuple(first), field), len(prompts)
    raise InvalidRequest(PROMPT_REQUIRED, param="prompt")


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(type(v) is int for v in value)


def text_logprobs(body: dict[str, Any]) -> int | None:
    value = body.get("logprobs")
    if value is None or value is False:
        return None
    if value is True:
        return 0
    if not isinstance(value, int):
        raise InvalidRequest("logprobs must be of type int", param="logprobs")
    if value < 0:
        raise InvalidRequest("logprobs must be at least 0", param="logprobs")
    if value > MAX_LOGPROBS:
        raise InvalidRequest(f"logprobs must be at most {MAX_LOGPROBS}", param="logprobs")
    return value


def echo_text(prompt: Prompt, stage: InferenceStage) -> str:
    """The prompt as `echo` puts it in front of the text: as sent, or its ids decoded."""
    if isinstance(prompt, TokenPrompt):
        return stage.model.tokenizer.decode(prompt.token_ids, skip_special_tokens=False)
    assert isinstance(prompt, TextPrompt)
    return prompt.text


def echo_logprobs_json(
    prompt: Sequence[TokenLogprob], generated: Sequence[TokenLogprob], text_offset: int = 0
) -> dict[str, Any]:
    """The legacy logprobs of the prompt's tokens, then the generated ones; the prompt's
    first token has no logprob (null)."""
    body = text_logprobs_json([*prompt, *generated], text_offset)
    if prompt:
        body["token_logprobs"][0] = None
        body["top_logprobs"][0] = None
    return body


def text_completion_json(
    meta: Mapping[str, Any], result: InferenceResult, echo: str | None = None
) -> dict[str, Any]:
    logprobs = None
    if result.logprobs is not None:
        logprobs = echo_logprobs_json(result.prompt_logprobs or (), result.logprobs)
    return {
        **meta,
        "object": "text_completion",
        "choices": [
            {
                "index": 0,
                "text": (echo or "") + result.text,
                "logprobs": logprobs,
                "finish_reason": result.finish_reason,
            }
        ],
        "usage": usage_json(result.usage),
    }


class TextStream:
    """The `text_completion` frames of one streamed answer."""

    def __init__(
        self,
        meta: Mapping[str, Any],
        include_usage: bool,
        want_logprobs: bool,
        echo: str | None = None,
    ):
        self.meta = {**meta, "object": "text_completion"}
        self.include_usage = include_usage
        self.want_logprobs = want_logprobs
        self.echo = echo  # the prompt, until the first chunk has carried it
        self.text_offset = 0
        self._text = TextFrames(lambda text: self._chunk(text, None))

    def _chunk(self, text: str, finish_reason: str | None, logprobs: Any = None, **extra: Any):
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return sse({**self.meta, "choices": [choice], **extra})

    def start(self) -> list[str]:
        return []

    def delta(self, event: CompletionEvent) -> list[str]:
        prefix, self.echo = self.echo or "", None
        text = prefix + event.text
        if not text and not event.logprobs:
            return []
        if self.want_logprobs and (event.logprobs or event.prompt_logprobs):
            logprobs = echo_logprobs_json(event.prompt_logprobs, event.logprobs, self.text_offset)
            frame = self._chunk(text, None, logprobs)
        else:
            frame = self._text(text)
        self.text_offset += len(text)
        return [frame]

    def finish(self, event: CompletionEvent) -> list[str]:
        assert event.usage is not None
        frames = self.delta(event)
        usage = usage_json(event.usage)
        if self.include_usage:
            frames.append(self._chunk("", event.finish_reason))
            frames.append(sse({**self.meta, "choices": [], "usage": usage}))
        else:
            frames.append(self._chunk("", event.finish_reason, usage=usage))
        frames.append(DONE)
        return frames

    def error(self, status: int, body: Mapping[str, Any]) -> list[str]:
        return [completion_stream_error(status, body)]
