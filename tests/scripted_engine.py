"""A scripted engine and a tiny model with the real APIs, for protocol tests without weights.

`ScriptedEngine` has the `Engine` surface (`submit`, async-iterable streams with `cancel`,
`stats`, `close`) and answers every prompt with the same pieces of text, one token per piece,
on a timer. It honours `max_tokens`, stop strings, logprobs and the batch/queue bounds, records
what it was asked, and can stall or fail on cue. `scripted_model()` builds a `LoadedModel` with a
character-level tokenizer and a ChatML template, so prompts render through the real `Tokenizer`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import tokenizers
import torch

from modelhost.engine.events import (
    EngineClosed,
    EngineEvent,
    EngineStats,
    PromptTooLong,
    QueueFull,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from modelhost.engine.sampling.sampling_params import SamplingParams
from modelhost.models.config import ModelConfig
from modelhost.models.families import family_for, family_for_model
from modelhost.models.loaded import LoadedModel
from modelhost.text.tokenizer import Tokenizer

_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_FIRST_SCRIPT_ID = 200  # ids the script "generates": past the character vocabulary


def char_tokenizer() -> tokenizers.Tokenizer:
    """A `tokenizers` backend with one token per printable character plus ChatML specials."""
    vocab = {token: index for index, token in enumerate(_SPECIALS)}
    vocab["<unk>"] = len(vocab)
    for char in [chr(code) for code in range(32, 127)] + ["\n"]:
        vocab[char] = len(vocab)
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = tokenizers.decoders.Fuse()
    backend.add_special_tokens(
        [tokenizers.AddedToken(token, special=True, normalized=False) for token in _SPECIALS]
    )
    return backend


# A ChatML template that prints the tools it is given, one JSON line each: a test reads what the
# model was offered (and the built-in tool prompt stays out: the template renders tools).
TOOLS_TEMPLATE = (
    "{% for tool in tools or [] %}{{ tool | tojson }}\n{% endfor %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def scripted_model(
    model_id: str = "scripted-model",
    *,
    context_length: int = 2048,
    gen_defaults: dict[str, float] | None = None,
    weights_bytes: int = 10_000_000,
    family: str = "llama",
    template: str | None = None,
) -> LoadedModel:
    """A tiny model; `family` picks its record (e.g. "qwen3" for tool-call and think markers),
    and `template`, a chat template of the model's own, the dialects it declares."""
    record = family_for(family) if template is None else family_for_model(family, template)
    config = ModelConfig(
        architecture="llama",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10_000.0,
        context_length=context_length,
    )
    tokenizer = Tokenizer(
        char_tokenizer(),
        chat_template=template or record.chat_template,
        eos_token_ids=[_SPECIALS.index("<|im_end|>")],
        add_bos_token=False,
        bos_token=None,
        eos_token="<|im_end|>",
    )
    return LoadedModel(
        id=model_id,
        path=Path("/nonexistent/scripted"),
        config=config,
        family=record,
        tokenizer=tokenizer,
        network=torch.nn.Identity(),
        device=torch.device("cpu"),
        dtype=torch.float32,
        weights_bytes=weights_bytes,
        gen_defaults=dict(gen_defaults or {}),
    )


@dataclass(slots=True)
class Submission:
    prompt_ids: list[int]
    params: SamplingParams


class ScriptedStream:
    def __init__(self, engine: ScriptedEngine, prompt_ids: list[int], params: SamplingParams):
        self._engine = engine
        self._prompt_ids = prompt_ids
        self._params = params
        self._events: asyncio.Queue[EngineEvent | BaseException] = asyncio.Queue()
        self.cancelled = False
        self.running = False
        self._task = asyncio.get_running_loop().create_task(self._produce())

    def __aiter__(self) -> ScriptedStream:
        return self

    async def __anext__(self) -> EngineEvent:
        if self.cancelled and self._events.empty():
            raise StopAsyncIteration
        item = await self._events.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            self._engine.num_cancelled += 1
            self._task.cancel()

    async def aclose(self) -> None:
        self.cancel()

    def fail(self, error: BaseException) -> None:
        """End the row with `error`, as a closing engine ends its rows."""
        self._task.cancel()
        self._events.put_nowait(error)

    async def _produce(self) -> None:
        engine = self._engine
        try:
            await engine.slots.acquire()
        except asyncio.CancelledError:
            engine.rows.discard(self)
            raise
        self.running = True
        try:
            await self._generate()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # handed to the consumer, as a failing step would be
            self._events.put_nowait(exc)
        finally:
            self.running = False
            engine.rows.discard(self)
            engine.slots.release()

    async def _generate(self) -> None:
        engine, params = self._engine, self._params
        text = ""
        emitted = 0
        for step, piece in enumerate(engine.script):
            if engine.fail_after is not None and step == engine.fail_after:
                raise RuntimeError("scripted failure")
            if engine.stall_after is not None and step == engine.stall_after:
                await asyncio.sleep(engine.stall_s)
            await asyncio.sleep(engine.step_s)
            token_id = _FIRST_SCRIPT_ID + step
            text += piece
            stop = next((s for s in params.stop if s in text), None)
            if stop is not None:
                shown = text[: text.index(stop)][emitted:]
                self._finish(shown, [token_id], step + 1, "stop", stop)
                return
            count = step + 1
            logprobs = self._logprobs(token_id, piece)
            if count >= params.max_tokens:
                self._finish(piece, [token_id], count, "length", None, logprobs)
                return
            emitted += len(piece)
            self._events.put_nowait(EngineEvent(piece, [token_id], logprobs))
        self._finish("", [], len(engine.script), "stop", None)

    def _logprobs(self, token_id: int, piece: str) -> list[TokenLogprob] | None:
        readout = self._params.readout_token_ids
        if readout:
            # A fixed preference for earlier readout ids: decisions read a known distribution.
            top = tuple(TopLogprob(t, str(t), -1.0 - i) for i, t in enumerate(readout))
            return [TokenLogprob(token_id, piece, -0.5, top)]
        if self._params.logprobs is None:
            return None
        top = tuple(
            TopLogprob(token_id + i, piece if i == 0 else f"alt{i}", -0.5 - i)
            for i in range(self._params.logprobs)
        )
        return [TokenLogprob(token_id, piece, -0.5, top)]

    def _finish(
        self,
        text: str,
        token_ids: list[int],
        completion_tokens: int,
        reason: str,
        stop: str | None,
        logprobs: list[TokenLogprob] | None = None,
    ) -> None:
        usage = Usage(len(self._prompt_ids), completion_tokens, self._engine.cached_tokens)
        event = EngineEvent(text, token_ids, logprobs, reason, stop, usage)  # type: ignore[arg-type]
        self._events.put_nowait(event)


class ScriptedEngine:
    """The Engine API over a fixed script: each piece is one token, one step apart."""

    def __init__(
        self,
        script: Sequence[str] = ("Hello", ",", " world", "!"),
        *,
        batch: int = 8,
        max_queue: int = 64,
        context_length: int = 2048,
        step_s: float = 0.0,
        stall_after: int | None = None,
        stall_s: float = 0.0,
        fail_after: int | None = None,
        cached_tokens: int = 0,
    ) -> None:
        self.script = list(script)
        self.batch = batch
        self.max_queue = max_queue
        self.context_length = context_length
        self.step_s = step_s
        self.stall_after = stall_after
        self.stall_s = stall_s
        self.fail_after = fail_after
        self.cached_tokens = cached_tokens
        self.submissions: list[Submission] = []
        self.rows: set[ScriptedStream] = set()
        self.num_cancelled = 0
        self.closed = False
        self._slots: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def slots(self) -> asyncio.Semaphore:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.batch)
        return self._slots

    def give_back_idle_memory(self, timeout_s: float = 5.0) -> bool:
        return not self.rows  # it holds no pool: nothing to give back

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> ScriptedStream:
        if self.closed:
            raise EngineClosed()
        if len(prompt_ids) >= self.context_length:
            raise PromptTooLong(len(prompt_ids), self.context_length)
        if len(self.rows) >= self.batch + self.max_queue:
            raise QueueFull()
        self._loop = asyncio.get_running_loop()
        self.submissions.append(Submission(list(prompt_ids), params))
        stream = ScriptedStream(self, list(prompt_ids), params)
        self.rows.add(stream)
        return stream

    def submit_many(self, rows: Sequence[tuple[list[int], SamplingParams]]) -> list[ScriptedStream]:
        if len(self.rows) + len(rows) > self.batch + self.max_queue:
            raise QueueFull()
        return [self.submit(prompt_ids, params) for prompt_ids, params in rows]

    def stats(self) -> EngineStats:
        active = sum(1 for row in self.rows if row.running)
        blocks = self.context_length // 16 + 1  # the pool holds one whole context
        return EngineStats(
            batch=self.batch,
            max_queue=self.max_queue,
            active_rows=active,
            pending_rows=len(self.rows) - active,
            submitted_rows=len(self.submissions),
            kv_blocks_total=blocks,
            kv_blocks_used=active,
            kv_blocks_cached_free=0,
            kv_block_size=16,
            kv_bytes=active * 16 * 1024,
            kv_budget_bytes=blocks * 16 * 1024,
            prefix_query_tokens=0,
            prefix_hit_tokens=0,
            context_length=self.context_length,
        )

    def close(self) -> None:
        """Refuse new rows and end every live one with EngineClosed; callable from any thread."""
        self.closed = True
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._fail_rows()
        else:
            with contextlib.suppress(RuntimeError):  # the loop may be closing
                loop.call_soon_threadsafe(self._fail_rows)

    def _fail_rows(self) -> None:
        for row in list(self.rows):
            row.fail(EngineClosed())
