"""The protocol-neutral hand-offs between the HTTP surfaces and the inference stage.

Every completion surface (OpenAI chat and text, Anthropic Messages, Responses) turns its wire
request into an `InferenceRequest`, and reads back either one `InferenceResult` or a stream of
`CompletionEvent`s (their logprobs and usage are the engine's own types). Refusals are
`RequestError`s carrying their HTTP status and a neutral error body that each surface reshapes
into its own error format.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from modelhost.engine.events import TokenLogprob, Usage
from modelhost.text.tool_calls import ToolCall

FinishReason = Literal["stop", "length", "tool_calls"]
# What a prompt longer than the window gets: a refusal (400), or its oldest turns dropped.
Overflow = Literal["error", "truncate"]


# ---------------------------------------------------------------------------------------------
# Requests


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A conversation to render with the model's chat template (messages already normalised)."""

    messages: tuple[Mapping[str, Any], ...]
    tools: tuple[Mapping[str, Any], ...] | None = None
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TextPrompt:
    """Raw text, tokenized as it is (no template)."""

    text: str


@dataclass(frozen=True, slots=True)
class TokenPrompt:
    """Token ids the client tokenized itself, prefilled as they are; `field` names where the
    request wrote them, for the 400 that refuses an id outside the model's vocabulary."""

    token_ids: tuple[int, ...]
    field: str = "prompt"


Prompt = ChatPrompt | TextPrompt | TokenPrompt


@dataclass(frozen=True, slots=True)
class ImagePart:
    """One image content part as a surface read it, in prompt order; the stage decodes it
    (inference/images.py) once it knows the model reads images."""

    where: str  # the part in the request, as a 400 names it: messages[0].content[1]
    source: str  # a data URL, bare base64, or a URL (refused unless fetching is allowed)
    param: str = "messages"  # the request field a 400 names


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """Output the stage must enforce with a grammar; the surface picked one by precedence.

    `source` is EBNF (grammar), a JSON schema as text (json_schema), a regex (regex) or
    xgrammar's structural tag as JSON text (structural_tag: tool calls in the built-in shape); a
    choice lists its strings in `choices`; json_object needs neither. `field` is the request field
    it came from, as the client wrote it (`response_format.json_schema`), for a 400 that names it.
    """

    kind: Literal["grammar", "json_schema", "json_object", "regex", "choice", "structural_tag"]
    source: str = ""
    choices: tuple[str, ...] = ()
    field: str = ""


@dataclass(frozen=True, slots=True)
class SamplingRequest:
    """The sampling knobs a request set; `None` means "not given" (defaults apply later)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    seed: int | None = None
    speculate: bool | None = None  # False: never guess ahead for this request (same tokens)


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    request_id: str
    method: Literal["chat", "text"]
    prompt: Prompt
    sampling: SamplingRequest = field(default_factory=SamplingRequest)
    max_tokens: int | None = None  # None: the server's --max-tokens, else up to the context
    max_tokens_field: str = "max_tokens"  # what the surface calls it, for a 400 that names it
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # generate to max_tokens even past end-of-sequence (benchmarks)
    logprobs: int | None = None  # None: off; N: the chosen token plus N alternatives
    prompt_logprobs: bool = False  # score the prompt's tokens too (`echo` with logprobs)
    stream: bool = False
    thinking: bool | None = None  # None: the template decides
    # Request shapes the stage may refuse to place (501), decided before any stream opens.
    num_choices: int = 1
    num_prompts: int = 1
    # A LoRA adapter of the model to run with (its name; None or "none": the bare base), and
    # the scale its update is added at.
    adapter: str | None = None
    adapter_scale: float = 1.0
    has_media: bool = False
    media: frozenset[str] = frozenset()  # kinds of media parts: image, audio, video, file
    images: tuple[ImagePart, ...] = ()  # the image parts, in the order the prompt shows them
    # Structured output: an instruction for the prompt, used when no grammar enforces it (a
    # Warning says so), and the grammar to enforce when the surface can express one.
    structured_output: str | None = None
    grammar: GrammarSpec | None = None
    # A prompt that leaves no room to generate: refused, or trimmed to fit (oldest turns
    # first); None: the server's --context-overflow.
    overflow: Overflow | None = None


# ---------------------------------------------------------------------------------------------
# Results


@dataclass(frozen=True, slots=True)
class CompletionEvent:
    """Text safe to show (stop strings already cut), in order. The last event of a stream is
    terminal: it has `finish_reason` and `usage` set (and may still carry text)."""

    text: str = ""
    num_tokens: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    stop_sequence: str | None = None  # the request's stop string that ended it, if one did
    reasoning: str = ""  # thinking text, split from `text` by the family's markers
    tool_calls: tuple[ToolCall, ...] = ()  # parsed calls; only on the terminal event
    # With prompt_logprobs, on the first event: one per prompt token, the first NaN.
    prompt_logprobs: tuple[TokenLogprob, ...] = ()

    @property
    def is_terminal(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class InferenceResult:
    request_id: str
    text: str
    finish_reason: FinishReason
    usage: Usage
    logprobs: tuple[TokenLogprob, ...] | None  # None when the request did not ask for them
    stop_sequence: str | None = None  # the request's stop string that ended it, if one did
    reasoning: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # when the request asked for them


# ---------------------------------------------------------------------------------------------
# What the discovery and status routes read


@dataclass(frozen=True, slots=True)
class ModelCard:
    id: str
    family: str
    created: int  # unix seconds
    context_window: int
    chat: bool  # has a chat template
    reasoning: bool
    tools: bool
    vision: bool
    gen_defaults: Mapping[str, float]
    adapters: bool = False  # takes LoRA adapters per request


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    max_safe_context: int | None  # from --memory-budget; None without one
    enforced_context_tokens: int  # the ceiling every prompt + completion must fit under
    memory_budget_bytes: int | None
    usable_bytes: int | None
    weights_bytes: int


@dataclass(frozen=True, slots=True)
class BatchStats:
    configured: int
    max_queue: int
    active_rows: int
    pending_rows: int
    submitted_rows: int
    kv_bytes: int
    kv_budget_bytes: int
    # bits (or "bf16") of a prompt's unread rows (--prompt-activations)
    prompt_activations: int | str = 16


@dataclass(frozen=True, slots=True)
class PromptCacheStats:
    cached_blocks: int
    cached_bytes: int
    max_bytes: int
    query_tokens: int
    hit_tokens: int


@dataclass(frozen=True, slots=True)
class SpeculationStats:
    mode: str = "none"  # in effect: auto, ngram, draft, or none (off, or not exact here)
    draft_tokens: int = 0  # tokens guessed ahead and verified
    accepted_tokens: int = 0  # of those, the ones the model agreed with
    verify_steps: int = 0  # steps that verified any guess
    draft_model: str | None = None  # the draft model guessing ahead, where there is one
    model_draft_tokens: int = 0  # of draft_tokens, the draft model's guesses
    model_accepted_tokens: int = 0  # of accepted_tokens, the draft model's
    draft_forwards: int = 0  # the draft model's forward passes

    @property
    def acceptance_rate(self) -> float | None:
        """The share of guesses kept; None before any guess."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None


@dataclass(frozen=True, slots=True)
class StageStats:
    model_id: str
    started_at: int  # unix seconds
    admission: AdmissionLimits
    batch: BatchStats
    prompt_cache: PromptCacheStats
    speculation: SpeculationStats = SpeculationStats()


# ---------------------------------------------------------------------------------------------
# Refusals


class RequestError(Exception):
    """A refusal with its HTTP status and a protocol-neutral body ({message, type, code, ...})."""

    def __init__(self, status: int, message: str, body: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.body: dict[str, Any] = dict(body) if body is not None else {"message": message}
        self.body.setdefault("message", message)


class InvalidRequest(RequestError):
    """A 400 for a malformed or out-of-range field; `param` names the field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        body = {"message": message, "type": "invalid_request_error", "code": code, "param": param}
        super().__init__(400, message, body)
        self.param = param


CONTEXT_OVER_BUDGET = "context_over_budget"


class ContextOverBudget(RequestError):
    """The prompt leaves no room to generate inside the enforced context (400). The body
    carries both sizes: each surface words the refusal as its clients recognise it, also
    from a worker process's JSON, where only the body crosses."""

    def __init__(self, message: str, prompt_tokens: int, limit: int) -> None:
        body = {
            "message": message,
            "type": "memory_admission",
            "code": CONTEXT_OVER_BUDGET,
            "prompt_tokens": prompt_tokens,
            "limit": limit,
        }
        super().__init__(400, message, body)
        self.prompt_tokens = prompt_tokens
        self.limit = limit


def overflow_sizes(body: Mapping[str, Any]) -> tuple[int, int] | None:
    """(prompt tokens, context limit) of a neutral `ContextOverBudget` body; None for any
    other body (or one without its sizes)."""
    if body.get("code") != CONTEXT_OVER_BUDGET:
        return None
    prompt_tokens, limit = body.get("prompt_tokens"), body.get("limit")
    if not isinstance(prompt_tokens, int) or not isinstance(limit, int):
        return None
    return prompt_tokens, limit


class QueueFullError(RequestError):
    """The engine's wait queue is at its bound (429)."""

    def __init__(self) -> None:
        message = "admission queue is full"
        body = {"message": message, "type": "resource_admission", "code": "queue_full"}
        super().__init__(429, message, body)


class UnsupportedExecution(RequestError):
    """The engine cannot place this request shape (501), decided before any stream opens."""

    def __init__(self, family: str, method: str, reasons: Sequence[str]) -> None:
        message = f"model {family} method {method} does not support shared execution"
        if reasons:
            message += ": " + ", ".join(reasons)
        body = {
            "message": message,
            "type": "not_implemented",
            "code": "unsupported_execution",
            "reasons": list(reasons),
        }
        super().__init__(501, message, body)
        self.reasons = tuple(reasons)


# What a request cut by the server's own shutdown is told, by the stage and by the front's
# relay alike.
SERVER_SHUTTING_DOWN = "the server is shutting down"


class EngineUnavailable(RequestError):
    """The engine closed (shutdown) while the request waited or ran (503)."""

    def __init__(self, message: str = "the engine is shutting down") -> None:
        body = {"message": message, "type": "server_closing", "code": "closed"}
        super().__init__(503, message, body)


class UnknownAdapterError(RequestError):
    """A request named an adapter the model does not have (404, as an unknown model)."""

    def __init__(self, name: str, model_id: str) -> None:
        message = f"The adapter '{name}' does not exist for model '{model_id}'"
        body = {
            "message": message,
            "type": "invalid_request_error",
            "code": "model_not_found",
            "param": "adapter",
        }
        super().__init__(404, message, body)


class RequestCancelled(RequestError):
    """The client went away (499); never logged as a server error."""

    def __init__(self) -> None:
        message = "request cancelled"
        body = {"message": message, "type": "request_cancelled", "code": "request_cancelled"}
        super().__init__(499, message, body)
