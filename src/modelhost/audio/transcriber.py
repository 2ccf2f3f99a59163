"""The transcription stage: one faster-whisper model, one request at a time.

`load_transcriber` opens a CTranslate2 Whisper directory (int8 on CPU, float16 on CUDA) without
touching the network. The stage decodes requests one after another on its own thread, so the
event loop stays free and two requests never share the model's threads; the next request waits
its turn in that thread's queue. Whisper yields segments as it decodes them: the streaming
variant passes each one on as a text delta, and a request whose client left stops at the next
segment (or before it starts, if it was still waiting).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, Unpack

import numpy as np

from modelhost.audio.decode import decode_audio, duration_s
from modelhost.audio.formats import Segment, Transcript, Word, language_code
from modelhost.audio.whisper_files import is_whisper_dir
from modelhost.inference.contracts import (
    AdmissionLimits,
    BatchStats,
    EngineUnavailable,
    InvalidRequest,
    PromptCacheStats,
    QueueFullError,
    RequestCancelled,
    StageStats,
)

if TYPE_CHECKING:
    from faster_whisper import WhisperModel

TASKS = ("transcribe", "translate")
MAX_QUEUE = 64  # requests waiting behind the one decoding; more is a 429, as the engine's queue
MAX_TOKENS_PER_WINDOW = 448  # Whisper's decoder context: one 30 s window's text
DEFAULT_BEAM_SIZE = 5
# Beyond the weights: mel features, the encoder's activations and the beams' decoder state.
# Measured on CPU with Whisper base (int8, beam 5, a 20 s clip): the process grew 172 MB while
# loading (model.bin is 145 MB) and 254 MB after a few requests.
WORKING_BYTES = 128 << 20

Audio = bytes | np.ndarray


class TranscriptionFields(TypedDict, total=False):
    """A request's fields, those of `TranscriptionOptions` (whose defaults apply)."""

    task: str
    language: str | None
    prompt: str | None
    temperature: float | None
    word_timestamps: bool
    beam_size: int


@dataclass(frozen=True, slots=True)
class TranscriptionOptions:
    task: str = "transcribe"
    language: str | None = None  # None: Whisper detects it
    prompt: str | None = None
    temperature: float | None = None  # None: 0, raised step by step when decoding fails
    word_timestamps: bool = False
    beam_size: int = DEFAULT_BEAM_SIZE


class TranscriptionStage:
    """A loaded Whisper model serving transcriptions and translations."""

    def __init__(
        self,
        model: WhisperModel,
        model_id: str,
        *,
        weights_bytes: int,
        device: str = "cpu",
        load_ms: float = 0.0,
    ) -> None:
        self.model_id = model_id
        self.device = device
        self.load_ms = load_ms
        self.weights_bytes = weights_bytes
        self.languages = frozenset(model.supported_languages)
        self._model: WhisperModel | None = model
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"whisper-{model_id}")
        self._running: set[threading.Event] = set()  # queued or decoding
        self._decoding = 0
        self._submitted = 0
        self._guard = threading.Lock()
        self._closed = False
        self.started_at = int(time.time())

    # -- the stage's interface ------------------------------------------------------------------

    async def transcribe(
        self,
        audio: Audio,
        **fields: Unpack[TranscriptionFields],
    ) -> Transcript:
        """The whole transcript of `audio` (encoded bytes, or 16 kHz mono float32 samples).
        `task="translate"` gives the English translation; `fields` as `options` takes them."""
        options = self.options(**fields)
        samples = await _samples(audio)
        stop = threading.Event()
        job = self._submit(samples, options, stop, None)
        try:
            return await asyncio.wrap_future(job)
        finally:
            self._forget(stop)  # the job is over, or its caller was cancelled (client gone)

    async def stream(
        self,
        audio: Audio,
        **fields: Unpack[TranscriptionFields],
    ) -> TranscriptDeltas:
        """Awaited, the transcript as an iterator of text deltas, one per segment as Whisper
        decodes it; together they are the transcript's text. A bad field or undecodable audio
        raises here, before any delta; stopping or closing the iterator early stops the
        decoding."""
        options = self.options(**fields)
        samples = await _samples(audio)
        loop = asyncio.get_running_loop()
        segments: asyncio.Queue[Segment | None] = asyncio.Queue()
        stop = threading.Event()

        def emit(segment: Segment) -> None:
            loop.call_soon_threadsafe(segments.put_nowait, segment)

        job = asyncio.wrap_future(self._submit(samples, options, stop, emit))
        job.add_done_callback(lambda _: segments.put_nowait(None))
        return TranscriptDeltas(self._deltas(job, segments, stop), stop)

    async def _deltas(
        self,
        job: asyncio.Future[Transcript],
        segments: asyncio.Queue[Segment | None],
        stop: threading.Event,
    ) -> AsyncGenerator[str]:
        written = ""
        try:
            while (segment := await segments.get()) is not None:
                delta = segment.text.lstrip() if not written else segment.text
                if delta:
                    written += delta
                    yield delta
            job.result()  # raises what the decoding raised
        finally:
            if not job.done():
                job.cancel()
            self._forget(stop)

    def options(self, **fields: Unpack[TranscriptionFields]) -> TranscriptionOptions:
        """Checked options; a value the model cannot take is a 400 naming its field."""
        asked = TranscriptionOptions(**fields)
        if asked.task not in TASKS:
            raise InvalidRequest(f"task must be one of {', '.join(TASKS)}", param="task")
        code = None
        if asked.language is not None and asked.language.strip():
            code = language_code(asked.language)
            if code is None or code not in self.languages:
                message = f"language {asked.language!r} is not one {self.model_id} knows"
                raise InvalidRequest(message, param="language")
        if asked.temperature is not None and not 0.0 <= asked.temperature <= 1.0:
            raise InvalidRequest("temperature must be between 0 and 1", param="temperature")
        if not 1 <= asked.beam_size <= 16:
            raise InvalidRequest("beam_size must be between 1 and 16", param="beam_size")
        return replace(asked, language=code, prompt=asked.prompt or None)

    def resident_bytes(self) -> int:
        """The weights (as `model.bin` holds them) plus one request's working memory."""
        return 0 if self._closed else self.weights_bytes + WORKING_BYTES

    def stats(self) -> StageStats:
        """For `/stats`: one row decodes, the rest wait; Whisper keeps no KV or prompt cache."""
        with self._guard:
            decoding, waiting = self._decoding, len(self._running) - self._decoding
            submitted = self._submitted
        return StageStats(
            model_id=self.model_id,
            started_at=self.started_at,
            admission=AdmissionLimits(
                max_safe_context=None,
                enforced_context_tokens=MAX_TOKENS_PER_WINDOW,
                memory_budget_bytes=None,
                usable_bytes=None,
                weights_bytes=self.weights_bytes,
            ),
            batch=BatchStats(
                configured=1,
                max_queue=MAX_QUEUE,
                active_rows=decoding,
                pending_rows=max(0, waiting),
                submitted_rows=submitted,
                kv_bytes=0,
                kv_budget_bytes=0,
            ),
            prompt_cache=PromptCacheStats(0, 0, 0, 0, 0),
        )

    def close(self) -> None:
        """Stop what runs, refuse what comes (503), and let the model go. Any thread may call."""
        with self._guard:
            self._closed = True
            self._model = None
            for stop in self._running:
                stop.set()
        self._worker.shutdown(wait=False)

    def _forget(self, stop: threading.Event) -> None:
        stop.set()
        with self._guard:
            self._running.discard(stop)

    # -- the worker thread -----------------------------------------------------------------

    def _submit(
        self,
        samples: np.ndarray,
        options: TranscriptionOptions,
        stop: threading.Event,
        emit: Callable[[Segment], None] | None,
    ) -> Future[Transcript]:
        with self._guard:
            if self._closed:
                raise EngineUnavailable(f"{self.model_id} is closed")
            if len(self._running) > MAX_QUEUE:
                raise QueueFullError()
            self._running.add(stop)
            self._submitted += 1
            try:
                return self._worker.submit(self._run, samples, options, stop, emit)
            except RuntimeError:  # shut down between the check and the submit
                self._running.discard(stop)
                raise EngineUnavailable(f"{self.model_id} is closed") from None

    def _run(
        self,
        samples: np.ndarray,
        options: TranscriptionOptions,
        stop: threading.Event,
        emit: Callable[[Segment], None] | None,
    ) -> Transcript:
        decoding = False
        try:
            model = self._model
            if model is None:
                raise EngineUnavailable(f"{self.model_id} is closed")
            if stop.is_set():
                raise RequestCancelled()
            with self._guard:
                self._decoding += 1
            decoding = True
            pieces, info = model.transcribe(samples, **_whisper_arguments(options))
            segments: list[Segment] = []
            for piece in pieces:  # a generator: each step decodes the next window
                if stop.is_set():
                    raise EngineUnavailable() if self._closed else RequestCancelled()
                segment = _segment(piece)
                segments.append(segment)
                if emit is not None:
                    emit(segment)
            return Transcript(
                task=options.task,
                language=info.language,
                duration=duration_s(samples),
                segments=tuple(segments),
            )
        finally:
            if decoding:
                with self._guard:
                    self._decoding -= 1
            self._forget(stop)


class TranscriptDeltas:
    """A streamed transcript's text deltas. `stop` ends the decoding at its next segment from
    any code, synchronous too: a server that sees its client leave stops it at once, before
    it gets round to closing the iterator."""

    def __init__(self, deltas: AsyncGenerator[str], stop: threading.Event) -> None:
        self._deltas = deltas
        self._stop = stop

    def __aiter__(self) -> TranscriptDeltas:
        return self

    async def __anext__(self) -> str:
        return await anext(self._deltas)

    def stop(self) -> None:
        self._stop.set()

    async def aclose(self) -> None:
        await self._deltas.aclose()


def load_transcriber(
    path: Path, model_id: str, *, device: str | None = None, cpu_threads: int | None = None
) -> TranscriptionStage:
    """A TranscriptionStage over the faster-whisper directory `path`: int8 on the CPU, float16
    on CUDA, with as many CPU threads as torch uses. Never downloads anything."""
    path = Path(path)
    if not is_whisper_dir(path):
        raise ValueError(
            f"{path} is not a faster-whisper model directory "
            "(model.bin, config.json, tokenizer.json and a vocabulary)"
        )
    import ctranslate2
    import torch
    from faster_whisper import WhisperModel

    if device is None:
        device = "cuda" if ctranslate2.get_cuda_device_count() > 0 else "cpu"
    compute_type = "float16" if device == "cuda" else "int8"
    threads = cpu_threads if cpu_threads is not None else torch.get_num_threads()
    started = time.monotonic()
    model = WhisperModel(
        str(path),
        device=device,
        compute_type=compute_type,
        cpu_threads=max(1, threads),
        num_workers=1,
        local_files_only=True,
    )
    load_ms = (time.monotonic() - started) * 1000
    weights = (path / "model.bin").stat().st_size
    return TranscriptionStage(
        model, model_id, weights_bytes=weights, device=device, load_ms=load_ms
    )


async def _samples(audio: Audio) -> np.ndarray:
    if isinstance(audio, np.ndarray):
        return audio.astype(np.float32, copy=False).reshape(-1)
    return await asyncio.to_thread(decode_audio, bytes(audio))


def _whisper_arguments(options: TranscriptionOptions) -> dict[str, Any]:
    arguments: dict[str, Any] = {
        "task": options.task,
        "language": options.language,
        "initial_prompt": options.prompt,
        "word_timestamps": options.word_timestamps,
        "beam_size": options.beam_size,
    }
    if options.temperature is not None:
        arguments["temperature"] = options.temperature
    return arguments


def _segment(piece: Any) -> Segment:
    words = tuple(
        Word(
            word=str(w.word),
            start=round(float(w.start), 3),
            end=round(float(w.end), 3),
            probability=float(w.probability),
        )
        for w in piece.words or ()
    )
    return Segment(
        id=int(piece.id) - 1,  # faster-whisper counts from 1; OpenAI from 0
        seek=int(piece.seek),
        start=round(float(piece.start), 3),
        end=round(float(piece.end), 3),
        text=str(piece.text),
        tokens=tuple(int(t) for t in piece.tokens),
        temperature=float(piece.temperature or 0.0),
        avg_logprob=float(piece.avg_logprob),
        compression_ratio=float(piece.compression_ratio),
        no_speech_prob=float(piece.no_speech_prob),
        words=words,
    )
