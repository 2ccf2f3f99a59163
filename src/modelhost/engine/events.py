"""What the engine hands back to its callers: typed events, usage and errors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]


class EngineError(Exception):
    """Base of the engine's typed refusals."""


class QueueFull(EngineError):
    """The wait queue is at its bound; the server answers 429 queue_full."""

    def __init__(self) -> None:
        super().__init__("admission queue is full")


class PromptTooLong(EngineError):
    """The prompt leaves no room to generate within the engine's context or KV pool."""

    def __init__(self, prompt_tokens: int, limit: int) -> None:
        super().__init__(f"prompt is {prompt_tokens} tokens but the context limit is {limit}")
        self.prompt_tokens = prompt_tokens
        self.limit = limit


class EngineClosed(EngineError):
    def __init__(self) -> None:
        super().__init__("engine is closed")


@dataclass(frozen=True, slots=True)
class TopLogprob:
    token_id: int
    token: str
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    # Speculation (engine/speculation.py): tokens guessed ahead for this answer and verified,
    # and of those the ones kept. The answer's tokens are the same either way.
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def prediction_details(self) -> dict[str, int]:
        """The guesses as OpenAI's predicted outputs name them (`accepted_prediction_tokens`,
        `rejected_prediction_tokens`), as LM Studio reports its draft model's; empty when
        nothing was guessed for this answer."""
        if not self.draft_tokens:
            return {}
        return {
            "accepted_prediction_tokens": self.accepted_draft_tokens,
            "rejected_prediction_tokens": self.draft_tokens - self.accepted_draft_tokens,
        }


@dataclass(slots=True)
class EngineEvent:
    """One step's output for one request.

    `text` is already stop-matched and held back: it is safe to show. `token_ids` are the ids
    generated this step (an event may carry text but no ids when held-back text is released at
    the end). The last event of a stream has `finish_reason` and `usage` set.
    """

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    stop_string: str | None = None  # the stop string that matched, when finish_reason is "stop"
    usage: Usage | None = None
    # With SamplingParams.prompt_logprobs, on the first token's event: one entry per prompt
    # token, the first with a NaN logprob (nothing precedes it).
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True, slots=True)
class EngineStats:
    batch: int  # configured maximum of running rows
    max_queue: int
    active_rows: int  # rows running now
    pending_rows: int  # rows waiting for a slot (including ones not yet handed to the loop)
    submitted_rows: int  # rows ever submitted
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_cached_free: int  # free blocks still holding a reusable prefix
    kv_block_size: int
    kv_bytes: int  # bytes of KV held by live rows
    kv_budget_bytes: int  # bytes of the whole pool at its ceiling
    prefix_query_tokens: int
    prefix_hit_tokens: int
    context_length: int  # the longest sequence (prompt + output) the engine places
    steps: int = 0  # forward passes run so far
    kv_committed_bytes: int = 0  # bytes of the pool that hold memory now (a growing pool)
    kv_store_queued_bytes: int = 0  # blocks copied for the disk KV store, not yet written
    speculate: str = "none"  # the engine's speculation mode in effect (engine/speculation.py)
    # bits (or "bf16") of a prompt's unread rows (engine/prompt_activations.py)
    prompt_activations: int | str = 16
    spec_draft_tokens: int = 0  # tokens guessed ahead and verified
    spec_accepted_tokens: int = 0  # of those, tokens the model agreed with
    spec_verify_steps: int = 0  # steps that verified any guess
    spec_draft_model: str | None = None  # the draft model's id, where one guesses ahead
    spec_model_draft_tokens: int = 0  # of spec_draft_tokens, the draft model's
    spec_model_accepted_tokens: int = 0  # of spec_accepted_tokens, the draft model's
    spec_draft_forwards: int = 0  # the draft model's forward passes
