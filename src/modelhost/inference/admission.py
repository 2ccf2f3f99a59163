"""Admission: the memory ceiling (400 or a silent clamp) and placement (501).

The *safe context* is resolved once per server from `--memory-budget`: the largest context whose
weights + KV cache + working memory fit the budget. Every request is then held to the
*enforced context*, the smallest of the safe context, the model's context window (or
`--context-length`) and the engine's own limit:

- a prompt that leaves no room to generate is a 400 `memory_admission`/`context_over_budget`,
  unless the request (Ollama's default) or `--context-overflow truncate` says to trim it
  (`prompt_fit`);
- otherwise the requested completion is clamped to the room left, silently.

Placement is decided from the request's shape alone, before any stream opens. The engine runs
every request as one row of the continuous batch (a LoRA adapter's rows too, over the shared
base weights), so it cannot place:

- `n > 1` (several choices per request): reason `multi-choice-batch-unsupported`;
- media content parts other than images (files; audio and video, which no tower here reads):
  `media-batch-unsupported`. Images are placed: the stage refused them already unless the
  model has a vision tower.
"""

from __future__ import annotations

from dataclasses import dataclass

from modelhost.inference.contracts import (
    ContextOverBudget,
    InferenceRequest,
    Overflow,
    UnsupportedExecution,
)
from modelhost.models.config import ModelConfig

BYTES_PER_GB = 1_000_000_000  # --memory-budget is in decimal GB
_MAX_CONTEXT_SEARCH = 1 << 24


class BudgetTooSmall(ValueError):
    """The memory budget cannot hold the weights plus any context at all (refused at load)."""


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    memory_budget_bytes: int
    usable_bytes: int
    weights_bytes: int
    kv_bytes_per_token: int
    max_safe_context: int
    working_bytes: int  # at max_safe_context

    @property
    def kv_bytes(self) -> int:
        """The KV bytes the budget leaves once weights and working memory are paid for."""
        return self.usable_bytes - self.weights_bytes - self.working_bytes


def working_bytes(
    config: ModelConfig, dtype_bytes: int, context: int, *, chunk_tokens: int, rows: int
) -> int:
    """Transient bytes of one engine step at `context`: activations of a prefill chunk, its
    fp32 attention scores against the whole context, and fp32 logits for every row."""
    chunk = max(1, min(context, chunk_tokens))
    activations = chunk * (4 * config.hidden_size + 3 * config.intermediate_size) * dtype_bytes
    scores = config.num_heads * chunk * max(context, 1) * 4
    logits = max(rows, 1) * config.vocab_size * 4
    return activations + scores + logits


def plan_memory(
    config: ModelConfig,
    *,
    weights_bytes: int,
    dtype_bytes: int,
    memory_budget_bytes: int,
    chunk_tokens: int = 512,
    rows: int = 8,
    kv_dtype_bytes: int | None = None,
    kv_token_bytes: int | None = None,
) -> MemoryPlan:
    """The largest context whose weights + KV + working memory fit `memory_budget_bytes`.
    `dtype_bytes` sizes activations, `kv_dtype_bytes` (default: the same) cached keys and
    values (fp16 on CPUs in the quantized modes, while activations stay fp32);
    `kv_token_bytes`, where given, what a token's KV costs (an 8-bit cache, kv_format.py)."""
    kv_per_token = kv_token_bytes or config.kv_bytes_per_token(kv_dtype_bytes or dtype_bytes)
    usable = memory_budget_bytes

    def fits(context: int) -> bool:
        work = working_bytes(config, dtype_bytes, context, chunk_tokens=chunk_tokens, rows=rows)
        return weights_bytes + context * kv_per_token + work <= usable

    if not fits(1):
        need_gb = (weights_bytes + kv_per_token) / BYTES_PER_GB
        raise BudgetTooSmall(
            f"--memory-budget {memory_budget_bytes / BYTES_PER_GB:g} GB cannot hold the weights "
            f"({weights_bytes / BYTES_PER_GB:.3f} GB) and any context; "
            f"at least {need_gb:.3f} GB is needed"
        )
    low, high = 1, _MAX_CONTEXT_SEARCH
    if fits(high):
        low = high
    while low < high:  # largest context that fits; fits() is monotone in the context
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    work = working_bytes(config, dtype_bytes, low, chunk_tokens=chunk_tokens, rows=rows)
    return MemoryPlan(
        memory_budget_bytes=memory_budget_bytes,
        usable_bytes=usable,
        weights_bytes=weights_bytes,
        kv_bytes_per_token=kv_per_token,
        max_safe_context=low,
        working_bytes=work,
    )


def budget_window(
    config: ModelConfig,
    *,
    weights_bytes: int,
    dtype_bytes: int,
    kv_token_bytes: int,
    budget_bytes: int | None,
    context_length: int | None = None,
    chunk_tokens: int = 512,
    rows: int = 8,
) -> int:
    """The window a model is served at by default: the largest context whose weights, KV and
    working memory `budget_bytes` (the model budget) holds, up to the model's trained length,
    and never above `context_length` (--context-length). Without a budget, or with one too
    small for the weights (the residency host refuses such a model when it is asked for), the
    trained length."""
    window = config.context_length
    if context_length is not None:
        window = min(window, context_length)
    if budget_bytes is None:
        return window
    try:
        plan = plan_memory(
            config,
            weights_bytes=weights_bytes,
            dtype_bytes=dtype_bytes,
            memory_budget_bytes=budget_bytes,
            chunk_tokens=chunk_tokens,
            rows=rows,
            kv_token_bytes=kv_token_bytes,
        )
    except BudgetTooSmall:
        return window
    return max(1, min(window, plan.max_safe_context))


@dataclass(frozen=True, slots=True)
class AdmissionPolicy:
    """The ceilings one serving unit enforces on every request."""

    context_window: int  # the model's window, or --context-length when smaller
    memory: MemoryPlan | None = None
    context_length_flag: bool = False  # the window came from --context-length
    overflow: Overflow = "error"  # --context-overflow: what a request that says nothing gets

    @property
    def enforced_context(self) -> int:
        if self.memory is None:
            return self.context_window
        return min(self.context_window, self.memory.max_safe_context)

    def limit(self, engine_context: int | None = None) -> int:
        """The tokens a prompt and its completion share: the enforced context, within what
        the engine can hold."""
        if engine_context is None:
            return self.enforced_context
        return min(self.enforced_context, engine_context)

    def overflow_for(self, request: InferenceRequest) -> Overflow:
        """What a prompt of `request` that leaves no room to generate gets."""
        return request.overflow or self.overflow

    def max_tokens_for(
        self, prompt_tokens: int, requested: int | None, *, engine_context: int | None = None
    ) -> int:
        """The completion budget of a prompt: `requested` clamped to the room left (or all of
        the room when nothing was requested). Raises ContextOverBudget when there is none."""
        limit = self.limit(engine_context)
        available = limit - prompt_tokens
        if available < 1:
            raise ContextOverBudget(self._refusal(prompt_tokens, limit), prompt_tokens, limit)
        return available if requested is None else min(requested, available)

    def _refusal(self, prompt_tokens: int, limit: int) -> str:
        if self.memory is not None and limit < self.context_window:
            return (
                f"prompt is {prompt_tokens} tokens but the memory budget caps safe context at "
                f"{limit} — no room to generate; shorten the prompt or raise --memory-budget"
            )
        hint = " or raise --context-length" if self.context_length_flag else ""
        return (
            f"prompt is {prompt_tokens} tokens but the context window is {limit} — "
            f"no room to generate; shorten the prompt{hint}"
        )


def placement_reasons(request: InferenceRequest) -> list[str]:
    """Why the continuous batch cannot place this request shape; empty when it can."""
    reasons: list[str] = []
    if request.has_media and not (request.media and request.media <= {"image"}):
        reasons.append("media-batch-unsupported")  # images reach here only on a vision model
    if request.num_choices > 1:
        reasons.append("multi-choice-batch-unsupported")
    if request.num_prompts > 1:
        reasons.append("multi-prompt-batch-unsupported")
    return reasons


def check_placement(request: InferenceRequest, family: str) -> None:
    """Raise the 501 for a request shape the engine cannot place."""
    reasons = placement_reasons(request)
    if reasons:
        raise UnsupportedExecution(family, request.method, reasons)
