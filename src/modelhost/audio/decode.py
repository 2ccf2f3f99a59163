"""Audio bytes to Whisper's input: 16 kHz mono float32 samples, decoded in-process with PyAV.

PyAV carries its own FFmpeg libraries, so WAV, MP3, OGG (Vorbis, Opus), FLAC, WebM, M4A and the
rest decode without an `ffmpeg` program on the machine. Anything that does not decode to audio
is a 400, and so is a clip too short to say anything.
"""

from __future__ import annotations

import io

import av
import numpy as np

from modelhost.inference.contracts import InvalidRequest

SAMPLE_RATE = 16_000
MIN_SECONDS = 0.1


class UndecodableAudio(InvalidRequest):
    """The upload is not audio PyAV can decode (400)."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"could not decode the audio file: {reason}", param="file")


class AudioTooShort(InvalidRequest):
    """The clip is under MIN_SECONDS (400)."""

    def __init__(self, seconds: float) -> None:
        message = f"audio is {seconds:.3f} s long; at least {MIN_SECONDS} s is needed"
        super().__init__(message, param="file")


def decode_audio(data: bytes) -> np.ndarray:
    """`data` (any container and codec FFmpeg reads) as 16 kHz mono float32 in [-1, 1].

    Raises UndecodableAudio or AudioTooShort."""
    if not data:
        raise UndecodableAudio("the file is empty")
    try:
        samples = _decode(data)
    except av.error.FFmpegError as exc:
        raise UndecodableAudio(_reason(exc)) from None
    seconds = samples.size / SAMPLE_RATE
    if seconds < MIN_SECONDS:
        raise AudioTooShort(seconds)
    return samples


def duration_s(samples: np.ndarray) -> float:
    return samples.size / SAMPLE_RATE


def _decode(data: bytes) -> np.ndarray:
    with av.open(io.BytesIO(data), mode="r", metadata_errors="ignore") as container:
        if not container.streams.audio:
            raise UndecodableAudio("it has no audio stream")
        stream = container.streams.audio[0]
        resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
        chunks: list[np.ndarray] = []
        for frame in _valid_frames(container.decode(stream)):
            frame.pts = None  # resample by sample count; broken timestamps do not matter here
            chunks.extend(out.to_ndarray().reshape(-1) for out in resampler.resample(frame))
        chunks.extend(out.to_ndarray().reshape(-1) for out in resampler.resample(None))
    if not chunks:
        return np.zeros(0, dtype=np.float32)
    return np.concatenate(chunks).astype(np.float32, copy=False)


def _valid_frames(frames):
    """The frames that decode; a corrupt packet in the middle of a file is skipped."""
    iterator = iter(frames)
    while True:
        try:
            yield next(iterator)
        except StopIteration:
            return
        except av.error.InvalidDataError:
            continue


def _reason(exc: av.error.FFmpegError) -> str:
    text = getattr(exc, "strerror", None) or str(exc)
    return text[0].lower() + text[1:] if text else type(exc).__name__
