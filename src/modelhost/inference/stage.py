"""The inference stage: admit an InferenceRequest into the engine, then run it.

`InferenceStage.admit` builds the prompt ids, checks placement (501), applies the memory ceiling
(400, or the prompt trimmed to fit where the request or the server says so; then a clamp),
resolves the sampling defaults and submits the row (429 when the queue is full).
It returns a single-use `AdmittedRequest`, which yields `CompletionEvent`s or one
`InferenceResult`. Whatever ends the request, the row is cancelled in a `finally`.

A stage knows only what it reads (InferenceRequest, the engine's API) and what it writes
(CompletionEvent, InferenceResult, the typed refusals of `contracts`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import weakref
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from modelhost.engine.events import (
    EngineClosed,
    EngineEvent,
    EngineStats,
    PromptTooLong,
    QueueFull,
)
from modelhost.inference.admission import AdmissionPolicy, check_placement
from modelhost.inference.channels import OutputChannels
from modelhost.inference.contracts import (
    SERVER_SHUTTING_DOWN,
    AdmissionLimits,
    BatchStats,
    ChatPrompt,
    CompletionEvent,
    ContextOverBudget,
    EngineUnavailable,
    FinishReason,
    GrammarSpec,
    InferenceRequest,
    InferenceResult,
    InvalidRequest,
    ModelCard,
    PromptCacheStats,
    QueueFullError,
    RequestError,
    SpeculationStats,
    StageStats,
    TokenLogprob,
    UnknownAdapterError,
    Usage,
)
from modelhost.inference.defaults import ServingDefaults, requested_max_tokens, resolve_sampling
from modelhost.inference.grammars.compiler import (
    GrammarInvalid,
    GrammarUnavailable,
    ModelGrammars,
    budget_refusal,
)
from modelhost.inference.grammars.tool_choice import lazy_tool_grammar
from modelhost.inference.image_prompt import BuiltPrompt, build_prompt
from modelhost.inference.images import NO_FETCH, ImageLimits
from modelhost.inference.media import check_media
from modelhost.inference.prompt import tool_form
from modelhost.inference.prompt_fit import answer_room, fit_prompt, trimmed_warning
from modelhost.models.adapters.refusals import AdapterRefused, AdaptersBusy, UnknownAdapter
from modelhost.models.loaded import LoadedModel

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar

    from modelhost.engine.engine import Engine
    from modelhost.models.adapters.adapter_set import AdapterSet
    from modelhost.models.adapters.row_adapters import AdapterUse

log = logging.getLogger(__name__)

GRAMMAR_WARNING = "grammar not enforced: no grammar engine - falling back to prompt injection"
TEXT_GRAMMAR_WARNING = "grammar not enforced: no grammar engine - output is not constrained"


def grammar_warning(reason: str, *, chat: bool) -> str:
    fallback = "falling back to prompt injection" if chat else "output is not constrained"
    return f"grammar not enforced: {reason} - {fallback}"


_GRAMMAR_FIELDS = {
    "grammar": "guided_grammar",
    "json_schema": "json_schema",
    "json_object": "response_format",
    "regex": "guided_regex",
    "choice": "guided_choice",
    "structural_tag": "tools",
}


def invalid_grammar(spec: GrammarSpec, reason: str) -> InvalidRequest:
    """The 400 for a grammar that does not compile, naming the field and the problem."""
    name = spec.field or _GRAMMAR_FIELDS[spec.kind]
    return InvalidRequest(f"{name} is not a valid grammar: {reason}", param=name.split(".")[0])


class InferenceStage:
    def __init__(
        self,
        engine: Engine,
        model: LoadedModel,
        *,
        policy: AdmissionPolicy | None = None,
        defaults: ServingDefaults | None = None,
        images: ImageLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
        adapters: AdapterSet | None = None,
    ) -> None:
        self.engine = engine
        self.adapters = adapters  # the model's LoRA adapters (None: it takes none)
        self.image_limits = images or NO_FETCH  # what an image may be, and URLs or not
        self.model = model
        self.policy = policy or AdmissionPolicy(context_window=model.config.context_length)
        self.defaults = defaults or ServingDefaults()
        self.clock = clock
        self.started_at = int(time.time())
        self.engine_context = _engine_context(engine.stats())
        self._live: weakref.WeakSet[AdmittedRequest] = weakref.WeakSet()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False
        self.grammars = ModelGrammars(model)

    @property
    def model_id(self) -> str:
        return self.model.id

    def resident_bytes(self) -> int:
        """What this stage holds: its weights and its loaded LoRA adapters', the part of its
        engine's KV pool that holds memory now (a growing pool's committed blocks; a
        preallocated pool whole) and the blocks copied for the disk KV store that its writer
        has not yet written."""
        batch = self.engine.stats()
        adapters = self.adapters.loaded_bytes() if self.adapters is not None else 0
        held = self.model.weights_bytes + adapters
        return held + batch.kv_committed_bytes + batch.kv_store_queued_bytes

    def give_back_idle_memory(self) -> bool:
        """The engine's KV pool given back now when no row runs (blocking): the residency
        host's ask before it evicts a model for room."""
        return self.engine.give_back_idle_memory()

    def stop_admission(self) -> None:
        """Refuse new requests (503) and let the admitted ones finish (a worker's drain)."""
        self._closing = True

    def in_flight(self) -> int:
        """Rows running or waiting in the engine."""
        batch = self.engine.stats()
        return batch.active_rows + batch.pending_rows

    @property
    def closing(self) -> bool:
        """The stage refuses new work: it is being closed."""
        return self._closing

    def card(self) -> ModelCard:
        family = self.model.family
        return ModelCard(
            id=self.model.id,
            family=family.name,
            created=self.started_at,
            context_window=min(self.policy.context_window, self.engine_context),
            chat=self.model.tokenizer.has_chat_template,
            reasoning=family.reasoning_markers is not None,
            tools=self.model.tokenizer.has_chat_template,  # generic parsing and forced calls
            vision=self.model.vision is not None,
            gen_defaults=dict(self.model.gen_defaults),
            adapters=self.adapters is not None,
        )

    async def admit(self, request: InferenceRequest) -> AdmittedRequest:
        """Refuse (RequestError) or submit the request's row; never opens a response."""
        arrived_at = self.clock()
        self._loop = asyncio.get_running_loop()
        if self._closing:
            raise EngineUnavailable()
        check_media(request.media, self.model.id, vision=self.model.vision is not None)
        check_placement(request, self.model.family.name)
        warnings: list[str] = []
        chat = isinstance(request.prompt, ChatPrompt)
        instruction = request.structured_output
        grammar = closing = None
        if request.grammar is not None:
            try:
                grammar = await self.grammars.compile(request.grammar)
                closing = await self.grammars.closing(request.grammar, grammar)
                instruction = None  # enforced: the prompt stays as the client wrote it
            except GrammarInvalid as exc:
                raise invalid_grammar(request.grammar, str(exc)) from exc
            except GrammarUnavailable as exc:
                warnings.append(grammar_warning(str(exc), chat=chat))
        elif instruction is not None:
            warnings.append(GRAMMAR_WARNING if chat else TEXT_GRAMMAR_WARNING)
        else:
            grammar = await self._chosen_call_grammar(request)
        built = await asyncio.to_thread(
            build_prompt, self.model, request, instruction, self.image_limits
        )
        requested = requested_max_tokens(request, self.defaults)
        limit = self.policy.limit(self.engine_context)
        if len(built.ids) >= limit and self.policy.overflow_for(request) == "truncate":
            budget = limit - answer_room(limit, requested)
            fitted = await asyncio.to_thread(
                fit_prompt, self.model, request, instruction, budget=budget
            )
            if fitted is not None:  # else refused below, with the prompt's own size
                warnings.append(trimmed_warning(len(fitted), len(built.ids)))
                built = BuiltPrompt(fitted)
        prompt_ids = built.ids
        tokenizer = self.model.tokenizer
        output = OutputChannels.for_request(
            request,
            self.model.family,
            lambda: tokenizer.decode(prompt_ids[-32:], skip_special_tokens=False),
            constrained=grammar is not None and request.grammar is not None,
        )
        max_tokens = self.policy.max_tokens_for(
            len(prompt_ids), requested, engine_context=self.engine_context
        )
        if closing is not None and request.grammar is not None:
            refusal = budget_refusal(
                request.grammar,
                closing.min_tokens,
                max_tokens,
                # A requested budget the context cut down is the context's fault, not the client's.
                requested=max_tokens == request.max_tokens,
                field=request.max_tokens_field,
            )
            if refusal is not None:
                raise refusal
        params = resolve_sampling(
            request, self.defaults, self.model.gen_defaults, max_tokens=max_tokens
        )
        if grammar is not None:
            plan = closing.plan if closing is not None else None
            params = dataclasses.replace(params, grammar=grammar, grammar_close=plan)
        adapter = await self._adapter_use(request)
        if adapter is not None:
            params = dataclasses.replace(params, adapter=adapter)
        try:
            if built.images:
                stream = self.engine.submit(prompt_ids, params, built.images)
            else:  # engines that read no images (tests' scripted ones) take two arguments
                stream = self.engine.submit(prompt_ids, params)
        except QueueFull as exc:
            raise QueueFullError() from exc
        except PromptTooLong as exc:
            limit = exc.limit
            message = (
                f"prompt is {len(prompt_ids)} tokens but the engine caps context at {limit} — "
                "no room to generate; shorten the prompt"
            )
            raise ContextOverBudget(message, len(prompt_ids), limit) from exc
        except EngineClosed as exc:
            raise EngineUnavailable() from exc
        admitted = AdmittedRequest(
            request_id=request.request_id,
            stream=stream,
            prompt_tokens=len(prompt_ids),
            max_tokens=max_tokens,
            warnings=tuple(warnings),
            want_logprobs=request.logprobs is not None,
            arrived_at=arrived_at,
            clock=self.clock,
            output=output,
            model_id=adapter.adapter.name if adapter is not None else self.model_id,
        )
        self._live.add(admitted)
        return admitted

    def adapter_names(self) -> list[str]:
        """The LoRA adapters requests may name, in the order they were added."""
        return self.adapters.names() if self.adapters is not None else []

    async def _adapter_use(self, request: InferenceRequest) -> AdapterUse | None:
        """The row's adapter at its scale (loaded again if it was let go); None: the base."""
        name = request.adapter
        if name in (None, "", "none"):
            return None
        assert name is not None
        if self.adapters is None or name not in self.adapters.names():
            raise UnknownAdapterError(name, self.model.id)
        try:
            return await asyncio.to_thread(self.adapters.use, name, request.adapter_scale)
        except UnknownAdapter:  # removed meanwhile
            raise UnknownAdapterError(name, self.model.id) from None
        except AdapterRefused as exc:
            raise InvalidRequest(str(exc), param="adapter", code="adapter_refused") from None
        except AdaptersBusy as exc:
            body = {"type": "resource_admission", "code": "adapters_busy"}
            raise RequestError(429, str(exc), body) from None

    async def _chosen_call_grammar(self, request: InferenceRequest) -> CompiledGrammar | None:
        """Under the built-in tool prompt, a model left to choose is held to a tool's schema once
        it opens a call; a schema the grammar engine cannot take leaves the call unconstrained
        (the parser still reads it), never refuses the request."""
        prompt = request.prompt
        if not isinstance(prompt, ChatPrompt) or not prompt.tools:
            return None
        if tool_form(self.model.family, self.model.tokenizer) != "builtin":
            return None
        spec = lazy_tool_grammar(prompt.tools)
        if spec is None:
            return None
        try:
            return await self.grammars.compile(spec)
        except (GrammarInvalid, GrammarUnavailable) as exc:
            log.warning("tool calls left unconstrained: %s", exc)
            return None

    def stats(self) -> StageStats:
        engine = self.engine.stats()
        memory = self.policy.memory
        bytes_per_block = engine.kv_budget_bytes // max(engine.kv_blocks_total, 1)
        return StageStats(
            model_id=self.model.id,
            started_at=self.started_at,
            admission=AdmissionLimits(
                max_safe_context=memory.max_safe_context if memory else None,
                enforced_context_tokens=min(self.policy.enforced_context, self.engine_context),
                memory_budget_bytes=memory.memory_budget_bytes if memory else None,
                usable_bytes=memory.usable_bytes if memory else None,
                weights_bytes=self.model.weights_bytes,
            ),
            batch=BatchStats(
                configured=engine.batch,
                max_queue=engine.max_queue,
                active_rows=engine.active_rows,
                pending_rows=engine.pending_rows,
                submitted_rows=engine.submitted_rows,
                kv_bytes=engine.kv_bytes,
                kv_budget_bytes=engine.kv_budget_bytes,
                prompt_activations=engine.prompt_activations,
            ),
            prompt_cache=PromptCacheStats(
                cached_blocks=engine.kv_blocks_cached_free,
                cached_bytes=engine.kv_blocks_cached_free * bytes_per_block,
                max_bytes=engine.kv_budget_bytes,
                query_tokens=engine.prefix_query_tokens,
                hit_tokens=engine.prefix_hit_tokens,
            ),
            speculation=SpeculationStats(
                mode=engine.speculate,
                draft_tokens=engine.spec_draft_tokens,
                accepted_tokens=engine.spec_accepted_tokens,
                verify_steps=engine.spec_verify_steps,
                draft_model=engine.spec_draft_model,
                model_draft_tokens=engine.spec_model_draft_tokens,
                model_accepted_tokens=engine.spec_model_accepted_tokens,
                draft_forwards=engine.spec_draft_forwards,
            ),
        )

    def close(self) -> None:
        """End every admitted request now (EngineUnavailable, 503), then close the engine.

        Callable from any thread: the requests are interrupted on their event loop at once,
        without waiting for the engine's current step to finish.
        """
        self._closing = True
        loop = self._loop
        if loop is not None and not loop.is_closed():
            if _running_loop() is loop:
                self._interrupt_all()
            else:
                with contextlib.suppress(RuntimeError):  # the loop is shutting down
                    loop.call_soon_threadsafe(self._interrupt_all)
        self.engine.close()

    def _interrupt_all(self) -> None:
        for admitted in list(self._live):
            admitted.interrupt(EngineUnavailable(SERVER_SHUTTING_DOWN))


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _engine_context(stats: EngineStats) -> int:
    """The longest row the engine can hold: its context window, and its whole KV pool."""
    pool_tokens = stats.kv_blocks_total * stats.kv_block_size - 1
    return min(stats.context_length, pool_tokens)


class AdmittedRequest:
    """One submitted row, runnable once: `events()` to stream, or `run()` for the whole result.

    Its counters (`completion_tokens`, `first_token_at`, `finish_reason`) are kept current for
    the request log. `cancel()` is idempotent and safe before, during or after a run.
    """

    def __init__(
        self,
        *,
        request_id: str,
        stream: Any,
        prompt_tokens: int,
        max_tokens: int,
        warnings: tuple[str, ...],
        want_logprobs: bool,
        arrived_at: float,
        clock: Callable[[], float],
        model_id: str,
        output: OutputChannels | None = None,
    ) -> None:
        self.request_id = request_id
        # What the answer names as its model: the adapter the row ran with, else the model.
        self.model_id = model_id
        self._output = output  # splits reasoning and tool calls out of the text
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.warnings = warnings
        self.want_logprobs = want_logprobs
        self.arrived_at = arrived_at
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.first_token_at: float | None = None
        self.finish_reason: FinishReason | None = None
        self._stream = stream
        self._clock = clock
        self._used = False
        self._cancelled = False
        self._interrupted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiter: asyncio.Task[Any] | None = None  # the task awaiting the engine's next event

    def cancel(self) -> None:
        if not self._cancelled:
            self._cancelled = True
            self._stream.cancel()

    def interrupt(self, error: Exception) -> None:
        """End the run with `error` at once (shutdown), cancelling the row; loop thread only."""
        if not self._interrupted.done():
            self._interrupted.set_exception(error)
            self._interrupted.exception()  # retrieved: a request never run must not warn
            if self._waiter is not None:
                self._waiter.cancel()
        self.cancel()

    async def events(self) -> AsyncIterator[CompletionEvent]:
        """The row's events, in order; the last one is terminal. Cancels the row when left."""
        if self._used:
            raise RuntimeError("admitted request has already been run")
        self._used = True
        try:
            while True:
                event = await self._next_event()
                if event is None:
                    raise EngineUnavailable("the engine ended the request without finishing it")
                completion = self._convert(event)
                if completion is not None and self._output is not None:
                    completion = self._output.apply(completion)
                    self.finish_reason = completion.finish_reason or self.finish_reason
                if completion is not None:
                    yield completion
                if completion is not None and completion.is_terminal:
                    return
        except EngineClosed as exc:
            raise EngineUnavailable() from exc
        finally:
            self.cancel()

    async def _next_event(self) -> EngineEvent | None:
        """The engine's next event (None at its end), unless the request is interrupted first.

        `interrupt` cancels this wait and the cancellation becomes the interruption's error:
        racing the event against an interrupt future instead cost a task and an
        `asyncio.wait` a token, on the loop that shares the cores with the engine."""
        if self._interrupted.done():
            self._interrupted.result()
        waiter = self._waiter = asyncio.current_task()
        try:
            return await anext(self._stream, None)
        except asyncio.CancelledError:
            # Once interrupted, the cancellation is `interrupt`'s (an interrupted request never
            # waits here again: the check above raises first); `uncancel` leaves 0 when nobody
            # else cancelled the task too.
            if self._interrupted.done() and waiter is not None and waiter.uncancel() == 0:
                self._interrupted.result()  # raises the interruption
            raise
        finally:
            self._waiter = None

    async def run(self) -> InferenceResult:
        text: list[str] = []
        reasoning: list[str] = []
        logprobs: list[TokenLogprob] = []
        prompt_logprobs: tuple[TokenLogprob, ...] | None = None
        terminal: CompletionEvent | None = None
        async for event in self.events():
            text.append(event.text)
            reasoning.append(event.reasoning)
            logprobs.extend(event.logprobs)
            prompt_logprobs = prompt_logprobs or event.prompt_logprobs or None
            terminal = event
        assert terminal is not None and terminal.finish_reason is not None
        assert terminal.usage is not None
        return InferenceResult(
            request_id=self.request_id,
            text="".join(text),
            finish_reason=terminal.finish_reason,
            usage=terminal.usage,
            logprobs=tuple(logprobs) if self.want_logprobs else None,
            stop_sequence=terminal.stop_sequence,
            reasoning="".join(reasoning),
            tool_calls=terminal.tool_calls,
            prompt_logprobs=prompt_logprobs,
        )

    def _convert(self, event: EngineEvent) -> CompletionEvent | None:
        if event.token_ids:
            self.completion_tokens += len(event.token_ids)
            if self.first_token_at is None:
                self.first_token_at = self._clock()
        logprobs = tuple(event.logprobs or ())
        prompt_logprobs = tuple(event.prompt_logprobs or ())
        if event.finish_reason is None:
            if not event.text and not event.token_ids and not logprobs:
                return None
            return CompletionEvent(
                text=event.text,
                num_tokens=len(event.token_ids),
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
            )
        if event.finish_reason == "abort":
            raise EngineUnavailable("the engine stopped the request (shutting down)")
        usage = event.usage
        if usage is not None:
            self.completion_tokens = usage.completion_tokens
            self.cached_tokens = usage.cached_tokens
        finish: FinishReason = "stop" if event.stop_string is not None else event.finish_reason
        self.finish_reason = finish
        return CompletionEvent(
            text=event.text,
            num_tokens=len(event.token_ids),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            finish_reason=finish,
            stop_sequence=event.stop_string,
            usage=Usage(
                prompt_tokens=usage.prompt_tokens if usage else self.prompt_tokens,
                completion_tokens=self.completion_tokens,
                cached_tokens=self.cached_tokens,
                draft_tokens=usage.draft_tokens if usage else 0,
                accepted_draft_tokens=usage.accepted_draft_tokens if usage else 0,
            ),
        )
