"""A stand-in for faster-whisper's model: segments handed out one by one, as the real one does,
so a test can hold a request between two segments."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np

from modelhost.audio.transcriber import TranscriptionStage

ONE_SECOND = np.zeros(16_000, dtype=np.float32)


class ScriptedWhisper:
    """Yields `texts` as segments; from the second on, each waits for `gate` (if given)."""

    supported_languages = ("en", "de")

    def __init__(self, texts: list[str], gate: threading.Event | None = None) -> None:
        self.texts = texts
        self.gate = gate
        self.calls = 0
        self.pulled = 0
        self.running = 0
        self.most_running = 0
        self.lock = threading.Lock()

    def transcribe(self, samples: np.ndarray, **options: Any) -> tuple[Iterator[Any], Any]:
        self.calls += 1
        return self._segments(), SimpleNamespace(language=options.get("language") or "en")

    def _segments(self) -> Iterator[Any]:
        with self.lock:
            self.running += 1
            self.most_running = max(self.most_running, self.running)
        try:
            for index, text in enumerate(self.texts):
                if index and self.gate is not None:
                    assert self.gate.wait(10)
                self.pulled += 1
                yield SimpleNamespace(
                    id=index + 1,
                    seek=0,
                    start=float(index),
                    end=index + 1.0,
                    text=text,
                    tokens=[1, 2],
                    temperature=0.0,
                    avg_logprob=-0.2,
                    compression_ratio=1.1,
                    no_speech_prob=0.01,
                    words=None,
                )
        finally:
            with self.lock:
                self.running -= 1


def stage_over(model: ScriptedWhisper) -> TranscriptionStage:
    return TranscriptionStage(model, "scripted-whisper", weights_bytes=1000)  # type: ignore[arg-type]
