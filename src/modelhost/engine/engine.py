"""The engine: a synchronous step loop in its own thread, fed by `submit` from any event loop.

engine = Engine(model, EngineConfig(batch=8))
stream = engine.submit(prompt_ids, params)   # QueueFull / PromptTooLong / EngineClosed at once
async for event in stream: ...               # the last event has finish_reason and usage
stream.cancel()                              # the row leaves within one step
streams = engine.submit_many([(ids, params), ...])   # admitted in the same step
engine.stats(); engine.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from collections.abc import Sequence as Rows
from dataclasses import dataclass

import torch

from modelhost.engine.draft_model import DraftModel, check_same_tokenizer
from modelhost.engine.events import (
    EngineClosed,
    EngineError,
    EngineEvent,
    EngineStats,
    FinishReason,
    PromptTooLong,
    QueueFull,
)
from modelhost.engine.kv.block_manager import BlockManager
from modelhost.engine.kv.kv_format import KVFormat, kv_token_bytes
from modelhost.engine.kv.kv_memory import grows_on
from modelhost.engine.kv.kv_pool_size import BLOCK_TOKENS, IDLE_KV_BYTES, default_kv_bytes
from modelhost.engine.kv.prefix_persistence import PrefixPersistence, kv_layout
from modelhost.engine.kv.prefix_store import PrefixStoreOpener
from modelhost.engine.prompt_activations import prompt_activation_bits
from modelhost.engine.row_output import RowOutput
from modelhost.engine.runner import ModelRunner
from modelhost.engine.sampling.prompt_logprobs import PromptScores, prompt_spans
from modelhost.engine.sampling.sampler import (
    SampledToken,
    chosen_token,
    probabilities,
    sample,
)
from modelhost.engine.sampling.sampling_params import SamplingParams
from modelhost.engine.sampling.speculative_sampling import accept_or_resample
from modelhost.engine.scheduler import (
    ScheduledRow,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from modelhost.engine.sequence import ImageSpan, Sequence
from modelhost.engine.speculation import SpeculateMode, Speculator, exact_for
from modelhost.models.loaded import LoadedModel

log = logging.getLogger(__name__)

GIL_SWITCH_INTERVAL_S = 0.0005


def share_the_gil_with_the_engine() -> None:
    """Shorten the interpreter's GIL switch interval to GIL_SWITCH_INTERVAL_S (never lengthen
    it). A process setting, so the processes that run engines call it where they start.

    The engine thread and the event loop that streams its tokens share the GIL: each step the
    engine waits for it once the forward pass returns from native code. Python's default 5 ms
    switch interval made that wait most of the gap between a step and the next token on the
    wire (SmolLM2, 8 streams: 118 -> 155 tok/s at 0.5 ms).
    """
    sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))


def set_threads(threads: int | None) -> None:
    """PyTorch's intra-op threads for this process's engines (`--threads`); None leaves its
    default (every core)."""
    if threads:
        torch.set_num_threads(max(1, threads))


class EngineFailure(EngineError):
    """The step loop failed while this row was in it; the message says why."""


@dataclass(frozen=True, slots=True)
class EngineConfig:
    batch: int = 8  # running rows
    max_queue: int = 64  # waiting rows beyond the free running slots
    kv_cache_bytes: int | None = None  # the KV pool's ceiling; None: 1 GiB, at least a context
    idle_kv_bytes: int = IDLE_KV_BYTES  # what a growing pool keeps once idle
    # How long an idle engine keeps its whole pool before giving back to `idle_kv_bytes`:
    # serve's --hold, while the residency host keeps the model from eviction anyway. An
    # agent's next turn, sent as its tool returns, then finds its prefix in memory instead of
    # reading it back from the disk store (issue 49).
    idle_hold_s: float = 0.0
    block_size: int = BLOCK_TOKENS
    max_num_batched_tokens: int = 512  # tokens per step: the prefill chunk size
    context_length: int | None = None  # None: the model's own window
    # `context_length` is the window the model budget holds (assembly.served_window): the
    # pool's default ceiling holds one whole window of it (kv_pool_size.default_kv_bytes).
    budgeted_window: bool = False
    # How the pool holds keys and values (engine/kv/kv_format.py): f16 (the model's cache
    # dtype) or q8 (int8 with a scale per token and head: ~half the bytes). --kv-cache.
    kv_cache: KVFormat = "f16"
    # Intra-op threads for steps that compute at least PROMPT_THREADS_MIN_TOKENS prompt tokens
    # (big matmuls), and the native weight kernels' threads in every step; None: every step on
    # the thread count already set, the native kernels on all cores.
    prompt_threads: int | None = None
    # Guess tokens ahead and verify them in one step (engine/speculation.py): auto where the
    # steps' measured cost says they pay, ngram for every decoding row, none never.
    speculate: SpeculateMode = "auto"
    # Bits of the quantized linears' activations for prompt tokens whose logits nobody reads:
    # 16 (every row alike), 8 (llama.cpp's: ~1.6x the prompt's linears, a little less precise;
    # decode, sampled and verifying rows stay at 16), or auto: 8 where it is measured faster
    # (engine/prompt_activations.py). --prompt-activations.
    prompt_activations: int | str = "auto"

    def token_bytes(self, model: LoadedModel) -> int:
        """What a token's keys and values cost in this engine's pool."""
        return kv_token_bytes(model.config, model.cache_dtype.itemsize, self.kv_cache)

    def num_blocks(self, model: LoadedModel, context_length: int) -> int:
        token_bytes = self.token_bytes(model)
        budget = self.kv_cache_bytes
        if budget is None:
            budget = default_kv_bytes(
                token_bytes,
                context_length,
                self.block_size,
                self.batch,
                budgeted=self.budgeted_window and grows_on(model.device),
            )
        return max(2, budget // (self.block_size * token_bytes))


class _RowEvents:
    """One row's events on its event loop, for its one reader: what an `asyncio.Queue` does
    here without its bounds, task counting and waiter lists, which ran for every token."""

    __slots__ = ("_items", "_loop", "_waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._items: deque[EngineEvent | BaseException] = deque()
        self._loop = loop
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: EngineEvent | BaseException) -> None:
        """On the loop's thread."""
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self) -> EngineEvent | BaseException:
        while not self._items:  # a cancelled wait leaves the items for the next one
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()


_Delivery = tuple[_RowEvents, EngineEvent | BaseException]  # a stream's buffer and its next item


class RequestStream:
    """The async side of one row: events arrive from the engine thread through the loop."""

    def __init__(self, engine: Engine, seq_id: int, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = seq_id
        self._engine = engine
        self._loop = loop
        self._events = _RowEvents(loop)
        self._done = False

    def _post(self, item: EngineEvent | BaseException) -> None:
        self._engine._outbox.setdefault(self._loop, []).append((self._events, item))

    def __aiter__(self) -> AsyncIterator[EngineEvent]:
        return self

    async def __anext__(self) -> EngineEvent:
        if self._done:
            raise StopAsyncIteration
        item = await self._events.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item.finish_reason is not None:
            self._done = True
        return item

    def cancel(self) -> None:
        if not self._done:
            self._done = True
            self._engine._abort(self.request_id)

    async def aclose(self) -> None:
        self.cancel()


class Engine:
    def __init__(
        self,
        model: LoadedModel,
        config: EngineConfig | None = None,
        prefix_store: PrefixStoreOpener | None = None,
        draft: LoadedModel | None = None,
    ) -> None:
        """`prefix_store`: where full prefix blocks outlive this engine (a disk store), opened
        with the KV layout's description; None keeps them in memory only. `draft`: a small
        model with `model`'s tokenizer that guesses ahead (engine/draft_model.py; DraftMismatch
        when its tokenizer differs)."""
        self.model = model
        self.config = config = config or EngineConfig()
        self.context_length = min(
            config.context_length or model.context_length, model.context_length
        )
        num_blocks = config.num_blocks(model, self.context_length)
        grows = grows_on(model.device)
        self.block_manager = BlockManager(num_blocks, config.block_size, grows=grows)
        self.scheduler = Scheduler(
            SchedulerConfig(
                batch=config.batch,
                max_queue=config.max_queue,
                max_num_batched_tokens=max(config.max_num_batched_tokens, config.batch),
                whole_images=model.vision is not None and model.vision.bidirectional,
            ),
            self.block_manager,
        )
        # The bits this model's prompt rows take (auto resolved against the model).
        self.prompt_activations = prompt_activation_bits(config.prompt_activations, model)
        self.runner = ModelRunner(
            model,
            num_blocks=num_blocks,
            block_size=config.block_size,
            prompt_threads=config.prompt_threads,
            grows=grows,
            coarse_prompts=self.prompt_activations != 16,
            coarse_bf16=self.prompt_activations == "bf16",
            kv_cache=config.kv_cache,
        )
        self.draft: DraftModel | None = None
        if draft is not None:
            check_same_tokenizer(model, draft)
            self.draft = DraftModel(
                draft,
                target_vocab_size=model.config.vocab_size,
                num_blocks=num_blocks,
                block_size=config.block_size,
                prompt_threads=config.prompt_threads,
            )
        # An 8-bit pool's verify rows past NATIVE_PROMPT_CONTEXT are read through PyTorch's
        # attention (the tiled prompt kernel does not read q8), not held to decode's answers
        # bit for bit: its guesses are not called exact.
        exact = exact_for(model) and config.kv_cache == "f16"
        self.speculator = Speculator(config.speculate, exact, self.draft)
        self._block_bytes = config.block_size * config.token_bytes(model)
        self.persistence: PrefixPersistence | None = None
        if prefix_store is not None:
            layout = kv_layout(self.runner.kv)
            if self.prompt_activations != 16:  # its prompts' blocks differ from 16-bit ones
                layout += f";prompt_activations={self.prompt_activations}"
            # The bytes of a q8 block mean int8 values and scales: a 16-bit engine never reads
            # them, nor a q8 engine a 16-bit block (the layout's dtype says so too). 16-bit
            # layouts keep the name they had, and the blocks stored under it.
            if config.kv_cache != "f16":
                layout += f";kv_cache={config.kv_cache}"
            store = prefix_store(layout)
            self.persistence = PrefixPersistence(store, self.runner.kv, self.block_manager)
        self._idle_keep_blocks = config.idle_kv_bytes // self._block_bytes
        self._give_back_at: float | None = None  # monotonic; set while idle within the hold
        self._ids = itertools.count(1)
        self._cond = threading.Condition()
        self._inbox: deque[Callable[[], None]] = deque()
        self._num_pending_adds = 0
        self._num_submitted = 0
        self._num_steps = 0
        self._closed = False
        self._live: dict[int, Sequence] = {}  # touched only by the engine thread
        # Events posted on the engine thread, by event loop, until `_deliver` (same thread).
        self._outbox: dict[asyncio.AbstractEventLoop, list[_Delivery]] = {}
        self._first_tokens = False  # this step emitted a row's first token (engine thread)
        self._prompt_scores = PromptScores(model.tokenizer)  # engine thread only
        self._thread = threading.Thread(target=self._loop, name=f"engine-{model.id}", daemon=True)
        self._thread.start()

    # ---- caller side (any thread with a running event loop) ------------------------------

    def submit(
        self, prompt_ids: list[int], params: SamplingParams, images: tuple[ImageSpan, ...] = ()
    ) -> RequestStream:
        """`images`: the prompt's images, whose placeholder tokens take the tower's rows."""
        if images and self.runner.images is None:
            raise ValueError("this model has no vision tower: a prompt with images")
        return self._submit([(prompt_ids, params, images)])[0]

    def submit_many(self, rows: Rows[tuple[list[int], SamplingParams]]) -> list[RequestStream]:
        """Submit rows as one unit: all or none are queued, and they reach the scheduler
        together, so rows that fit the free slots and the step's token budget are admitted in
        the same step (typed decisions answer all of a request's questions in one forward)."""
        return self._submit([(prompt_ids, params, ()) for prompt_ids, params in rows])

    def _submit(
        self, rows: Rows[tuple[list[int], SamplingParams, tuple[ImageSpan, ...]]]
    ) -> list[RequestStream]:
        checked = [(*self._checked(ids, params), images) for ids, params, images in rows]
        loop = asyncio.get_running_loop()
        with self._cond:
            if self._closed:
                raise EngineClosed()
            if not self.scheduler.has_room(self._num_pending_adds + len(checked) - 1):
                raise QueueFull()
            seqs: list[Sequence] = []
            streams: list[RequestStream] = []
            for prompt_ids, params, images in checked:
                seq = Sequence.from_prompt(
                    next(self._ids),
                    prompt_ids,
                    params,
                    self.model.tokenizer.eos_token_ids,
                    images,
                )
                stream = RequestStream(self, seq.seq_id, loop)
                seq.payload = RowOutput(seq, self.model.tokenizer, stream._post)
                seqs.append(seq)
                streams.append(stream)
            self._num_pending_adds += len(seqs)
            self._num_submitted += len(seqs)
            self._inbox.append(lambda: self._add_all(seqs))
            self._cond.notify()
        return streams

    def _checked(
        self, prompt_ids: list[int], params: SamplingParams
    ) -> tuple[list[int], SamplingParams]:
        num_prompt = len(prompt_ids)
        if num_prompt == 0:
            raise PromptTooLong(0, self.context_length)  # nothing to condition on
        if num_prompt >= self.context_length or not self.block_manager.fits(num_prompt):
            raise PromptTooLong(num_prompt, min(self.context_length, self._pool_tokens()))
        room = min(self.context_length, self._pool_tokens()) - num_prompt
        if params.max_tokens > room:
            params = dataclasses.replace(params, max_tokens=room)
        return prompt_ids, params

    def _abort(self, seq_id: int) -> None:
        with self._cond:
            self._inbox.append(lambda: self.scheduler.abort(seq_id))
            self._cond.notify()

    def give_back_idle_memory(self, timeout_s: float = 5.0) -> bool:
        """Give back the KV pool's memory now, as the idle hold's end would, if no row runs or
        waits (any thread): the residency host asks before evicting a model for room. True
        once done (or nothing was held); False when rows run or the engine did not answer."""
        done = threading.Event()
        idle = [False]

        def give_back() -> None:
            if not self.scheduler.has_work:
                idle[0] = True
                self._give_back_at = None
                self._give_back()
            done.set()

        with self._cond:
            if self._closed:
                return False
            self._inbox.append(give_back)
            self._cond.notify()
        return done.wait(timeout_s) and idle[0]

    def stats(self) -> EngineStats:
        manager = self.block_manager
        return EngineStats(
            batch=self.config.batch,
            max_queue=self.config.max_queue,
            active_rows=self.scheduler.num_running,
            pending_rows=self.scheduler.num_waiting + self._num_pending_adds,
            submitted_rows=self._num_submitted,
            kv_blocks_total=manager.num_blocks,
            kv_blocks_used=manager.num_used_blocks,
            kv_blocks_cached_free=manager.num_cached_free_blocks,
            kv_block_size=self.config.block_size,
            kv_bytes=manager.num_used_blocks * self._block_bytes,
            kv_budget_bytes=manager.num_blocks * self._block_bytes,
            prefix_query_tokens=manager.num_prefix_queries_tokens,
            prefix_hit_tokens=manager.num_prefix_hit_tokens,
            context_length=self.context_length,
            steps=self._num_steps,
            kv_committed_bytes=manager.num_committed * self._block_bytes,
            kv_store_queued_bytes=(
                self.persistence.queued_bytes if self.persistence is not None else 0
            ),
            speculate=self.speculator.mode,
            prompt_activations=self.prompt_activations,
            spec_draft_tokens=self.speculator.counts.draft_tokens,
            spec_accepted_tokens=self.speculator.counts.accepted_tokens,
            spec_verify_steps=self.speculator.counts.verify_steps,
            spec_draft_model=self.draft.model.id if self.draft is not None else None,
            spec_model_draft_tokens=self.speculator.counts.model_draft_tokens,
            spec_model_accepted_tokens=self.speculator.counts.model_accepted_tokens,
            spec_draft_forwards=self.speculator.counts.draft_forwards,
        )

    def close(self, timeout_s: float = 10.0) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout_s)

    def _pool_tokens(self) -> int:
        return self.block_manager.num_blocks * self.config.block_size - 1

    # ---- engine thread ---------------------------------------------------------------------

    def _add_all(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self._num_pending_adds -= 1
            self._live[seq.seq_id] = seq
            if self.persistence is not None:
                self._restore(self.persistence, seq)
            self.scheduler.add(seq)

    def _restore(self, persistence: PrefixPersistence, seq: Sequence) -> None:
        try:
            persistence.restore(seq)
        except Exception:  # a store that fails costs a prefill, never the row
            log.exception("reading the KV store failed")

    def _loop(self) -> None:
        try:
            self._run()
        finally:
            if self.persistence is not None:  # what the pool caches outlives it
                try:
                    self.persistence.close()
                except Exception:
                    log.exception("writing the KV store failed")

    def _run(self) -> None:
        while True:
            with self._cond:
                held_out = self._wait_for_work()
                if self._closed:
                    break
                commands = list(self._inbox)
                self._inbox.clear()
            if held_out:
                self._give_back()
                continue
            for command in commands:
                command()
            try:
                with torch.inference_mode():
                    self._step()
            except Exception as exc:  # a failed step fails its rows, never the loop
                log.exception("engine step failed")
                self._fail_all(EngineFailure(f"engine step failed: {exc}"))
        self._fail_all(EngineClosed())

    def _wait_for_work(self) -> bool:
        """Wait (holding `_cond`) for a command, a row or the end; True when the idle hold ran
        out first, so the pool's memory should go back now."""
        while not self._closed and not self._inbox and not self.scheduler.has_work:
            if self._give_back_at is None:
                self._cond.wait()
                continue
            left = self._give_back_at - time.monotonic()
            if left <= 0:
                self._give_back_at = None
                return True
            self._cond.wait(left)
        return False

    def _step(self) -> None:
        # While more steps follow, a step's events wait for the next step's layers to start:
        # the event loops they wake then run while the kernels have let go of the GIL, instead
        # of taking turns with this thread's Python between the steps (SmolLM2, one stream
        # through HTTP: the loop's CPU 299 -> 251 us a token, ~0.35 ms later a token).
        # A row's first token is the exception: it goes out at once, while this thread
        # prepares the next step, rather than after it (a short cached prompt's first token is
        # a person's wait, not a stream's cadence; issue 48).
        held, self._outbox = self._outbox, {}
        self._first_tokens = False
        steps = self._num_steps
        try:
            self._step_rows(before_layers=lambda: _deliver(held))
        finally:
            _deliver(held)  # this step computed nothing, or failed
            if not self.scheduler.has_work:
                self._deliver()
                if self.config.idle_hold_s <= 0:
                    self._give_back()
                elif self._num_steps != steps or self._give_back_at is None:
                    # Rows ran (or left unrun, cancelled): the hold starts from here.
                    self._give_back_at = time.monotonic() + self.config.idle_hold_s
            elif self._first_tokens:
                self._deliver()

    def _give_back(self) -> None:
        """Return the pool's memory above what an idle engine keeps (IDLE_KV_BYTES of prefix
        cache), once idle for `idle_hold_s`. Only when idle: mid-burst the next rows would
        fault the same pages in again on the request path, and the residency host plans
        around idle models (it evicts only those, and counts a busy model's admitted rows as a
        claim on top of what it holds), so idle is when what a model holds must come back
        down. Within the hold the host keeps the model anyway, and counts what it measures."""
        first = self.block_manager.release_tail(self._idle_keep_blocks)
        if first is not None:
            self.runner.release_blocks_from(first)
        if self.draft is not None:
            self.draft.give_back(self._idle_keep_blocks)

    def _deliver(self) -> None:
        _deliver(self._outbox)

    def _step_rows(self, before_layers: Callable[[], None]) -> None:
        out = self.scheduler.schedule()
        for seq in out.finished:
            self._finish(seq, EngineEvent(), seq.finish_reason or "abort", None)
        if out.is_empty:
            return
        planned = self.speculator.plan(
            out,
            self.block_manager,
            self.scheduler.config.max_num_batched_tokens,
            lambda seq: _output(seq).sampling,
        )
        # A step's cost for speculation: the forward, and sampling and emitting each position
        # (a draft model's forwards in `plan` are counted apart, engine/speculation.py).
        started = time.perf_counter()
        if planned:
            self._verify_step(out, before_layers)
            self.speculator.observe(out, time.perf_counter() - started)
            return
        sampling_rows = [row.seq for row in out.rows if row.samples]
        logits = self.runner.execute(out, before_layers)
        self._num_steps += 1
        logits = self._score_prompts(out, logits, len(sampling_rows))
        tokens = sample(logits, [_output(seq).sampling for seq in sampling_rows])
        sampled = {
            seq.seq_id: token.token_id for seq, token in zip(sampling_rows, tokens, strict=True)
        }
        self.scheduler.update(out, sampled)
        for seq, token in zip(sampling_rows, tokens, strict=True):
            self._emit(seq, token)
        self.speculator.observe(out, time.perf_counter() - started)

    def _verify_step(self, out: SchedulerOutput, before_layers: Callable[[], None]) -> None:
        """A decode step where some rows carry guesses: every row's positions have logits,
        in row order; rows without a draft are sampled together as in `_step_rows`."""
        logits = self.runner.execute(out, before_layers)
        self._num_steps += 1
        plain: list[int] = []
        spans: list[tuple[ScheduledRow, int]] = []
        offset = 0
        for row in out.rows:
            if row.draft:
                spans.append((row, offset))
            else:
                plain.append(offset)
            offset += row.num_tokens
        plain_rows = [row for row in out.rows if not row.draft]
        if plain_rows:
            index = torch.tensor(plain, dtype=torch.long, device=logits.device)
            tokens = sample(
                logits.index_select(0, index), [_output(row.seq).sampling for row in plain_rows]
            )
            self.scheduler.update(
                SchedulerOutput(rows=plain_rows),
                {row.seq.seq_id: t.token_id for row, t in zip(plain_rows, tokens, strict=True)},
            )
            for row, token in zip(plain_rows, tokens, strict=True):
                self._emit(row.seq, token)
        for row, start in spans:
            self._verify_row(row, logits[start : start + row.num_tokens])

    def _verify_row(self, row: ScheduledRow, logits: torch.Tensor) -> None:
        """Sample the row's positions one after the other, as that many decode steps would,
        keeping each guess the sampled token agrees with; the first disagreement (or the row's
        end) is the last token of the step."""
        if row.draft_probs is not None:
            self._verify_drawn_row(row, logits)
            return
        seq, draft = row.seq, row.draft
        sampling = _output(seq).sampling
        params = seq.params
        # A row whose choice reads nothing its own earlier tokens change (greedy, no penalties)
        # samples every position in one call; the others one position at a time.
        at_once = (
            params.greedy
            and params.repetition_penalty == 1.0
            and not params.presence_penalty
            and not params.frequency_penalty
            and sampling.grammar is None
        )
        batch = sample(logits, [sampling] * logits.shape[0]) if at_once else None
        appended = accepted = 0
        for i in range(logits.shape[0]):
            token = batch[i] if batch is not None else sample(logits[i : i + 1], [sampling])[0]
            appended += 1
            kept = i < len(draft) and token.token_id == draft[i]
            accepted += kept
            self._take(seq, token, len(draft) if i == 0 else 0, kept)
            if seq.is_finished or not kept:
                break
        self.scheduler.settle_verified(row, appended)
        self.speculator.learn(seq, len(draft), accepted)

    def _verify_drawn_row(self, row: ScheduledRow, logits: torch.Tensor) -> None:
        """Speculative sampling over a row whose guesses the draft model drew from q: each is
        kept with probability min(1, p/q), the first that is not is replaced by a draw from the
        residual, and when all are kept the last position's token is sampled as usual."""
        seq, draft = row.seq, row.draft
        q = row.draft_probs
        assert isinstance(q, torch.Tensor)
        sampling = _output(seq).sampling
        appended = accepted = 0
        for i in range(len(draft) + 1):
            raw = logits[i : i + 1]
            if i == len(draft):
                token, kept = sample(raw, [sampling])[0], False
            else:
                p = probabilities(raw.clone(), [sampling])[0]
                token_id, kept = accept_or_resample(p, q[i], draft[i], sampling.generator)
                token = chosen_token(raw, token_id, sampling)
            appended += 1
            accepted += kept
            self._take(seq, token, len(draft) if i == 0 else 0, kept)
            if seq.is_finished or not kept:
                break
        self.scheduler.settle_verified(row, appended)
        self.speculator.learn(seq, len(draft), accepted)

    def _take(self, seq: Sequence, token: SampledToken, drafted: int, kept: bool) -> None:
        """Append and emit one token of a verified row, its guesses counted first: the
        row's last event carries its counts in its usage."""
        seq.num_draft_tokens += drafted
        seq.num_accepted_tokens += kept
        self.scheduler.accept_token(seq, token.token_id)
        self._emit(seq, token)

    def _score_prompts(
        self, out: SchedulerOutput, logits: torch.Tensor, num_sampling: int
    ) -> torch.Tensor:
        """Record prompt logprobs from the logits past the sampling rows'; the rest."""
        if logits.shape[0] > num_sampling:
            self._prompt_scores.add(prompt_spans(out.rows), logits[num_sampling:])
            logits = logits[:num_sampling]
        return logits

    def _emit(self, seq: Sequence, token: SampledToken) -> None:
        output = _output(seq)
        self._first_tokens = self._first_tokens or seq.num_generated_tokens == 1
        event, matched = output.event_for(seq, token)
        if seq.params.prompt_logprobs and seq.num_generated_tokens == 1:
            event.prompt_logprobs = self._prompt_scores.pop(seq)
        if matched is not None:
            self.scheduler.finish(seq, "stop")
            self._finish(seq, event, "stop", matched)
        elif seq.is_finished:
            self._finish(seq, event, seq.finish_reason or "stop", None)
        elif output.grammar_done:
            self.scheduler.finish(seq, "stop")
            self._finish(seq, event, "stop", None)
        else:
            output.post(event)

    def _finish(
        self, seq: Sequence, event: EngineEvent, reason: FinishReason, stop: str | None
    ) -> None:
        output = _output(seq)
        output.post(output.finish(event, seq, reason, stop))
        self._live.pop(seq.seq_id, None)
        self._prompt_scores.forget(seq.seq_id)
        self.speculator.forget(seq.seq_id)

    def _fail_all(self, error: EngineError) -> None:
        with self._cond:  # rows submitted but not yet handed over fail too
            commands = list(self._inbox)
            self._inbox.clear()
        for command in commands:
            command()
        for seq in list(self._live.values()):
            self.scheduler.finish(seq, "abort")
            self.speculator.forget(seq.seq_id)
            _output(seq).post(error)
        self._live.clear()
        self._deliver()


def _deliver(outbox: dict[asyncio.AbstractEventLoop, list[_Delivery]]) -> None:
    """Hand the posted events to their event loops and empty `outbox`: one wake-up per loop,
    which a step's rows share instead of each waking the loop (and taking a core from the
    kernels' threads) on its own."""
    for loop, items in outbox.items():
        # RuntimeError: the consumer's loop is gone; its rows are being cancelled anyway.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_put_all, items)
    outbox.clear()


def _put_all(items: list[_Delivery]) -> None:
    for events, item in items:
        events.put(item)


def _output(seq: Sequence) -> RowOutput:
    return seq.payload  # type: ignore[return-value]
