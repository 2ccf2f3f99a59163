"""Uploaded audio becomes 16 kHz mono float32 in-process, whatever its container."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest
from audio_files import ENGLISH, NOT_AUDIO

from modelhost.audio.decode import SAMPLE_RATE, AudioTooShort, UndecodableAudio, decode_audio


def encode_tone(container: str, codec: str, rate: int, seconds: float = 1.0) -> bytes:
    """A stereo 440 Hz tone of `seconds`, encoded with PyAV's own FFmpeg."""
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=container) as out:
        stream = out.add_stream(codec, rate=rate, layout="stereo")
        tone = 0.3 * np.sin(2 * np.pi * 440 * np.arange(int(rate * seconds)) / rate)
        frame = av.AudioFrame.from_ndarray(
            np.stack([tone, tone]).astype(np.float32), format="fltp", layout="stereo"
        )
        frame.sample_rate = rate
        fifo = av.AudioFifo()
        resampler = av.AudioResampler(format=stream.format, layout="stereo", rate=rate)
        for piece in resampler.resample(frame):
            fifo.write(piece)
        frame_size = stream.codec_context.frame_size or 1024
        while (chunk := fifo.read(frame_size) or fifo.read()) is not None:
            out.mux(stream.encode(chunk))
        out.mux(stream.encode(None))
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("container", "codec", "rate"),
    [
        ("wav", "pcm_s16le", 44_100),
        ("mp3", "libmp3lame", 44_100),
        ("ogg", "libopus", 48_000),
        ("flac", "flac", 22_050),
        ("webm", "libopus", 48_000),
    ],
)
def test_common_containers_decode_to_16_khz_mono_float32(
    container: str, codec: str, rate: int
) -> None:
    samples = decode_audio(encode_tone(container, codec, rate))
    assert samples.dtype == np.float32
    assert samples.ndim == 1
    assert samples.size == pytest.approx(SAMPLE_RATE, rel=0.05)
    assert 0.2 < float(np.abs(samples).max()) <= 1.0


def test_the_speech_fixture_decodes_to_its_length() -> None:
    samples = decode_audio(ENGLISH.read_bytes())
    assert samples.size / SAMPLE_RATE == pytest.approx(4.86, abs=0.02)


def test_text_is_undecodable_and_a_400_on_the_file_field() -> None:
    with pytest.raises(UndecodableAudio) as refused:
        decode_audio(NOT_AUDIO.read_bytes())
    assert refused.value.status == 400
    assert refused.value.body["param"] == "file"


def test_an_empty_upload_is_undecodable() -> None:
    with pytest.raises(UndecodableAudio):
        decode_audio(b"")


def test_a_clip_under_a_tenth_of_a_second_is_too_short() -> None:
    with pytest.raises(AudioTooShort) as refused:
        decode_audio(encode_tone("wav", "pcm_s16le", 16_000, seconds=0.05))
    assert refused.value.status == 400


def test_a_clip_of_a_tenth_of_a_second_is_long_enough() -> None:
    samples = decode_audio(encode_tone("wav", "pcm_s16le", 16_000, seconds=0.1))
    assert samples.size == SAMPLE_RATE // 10
