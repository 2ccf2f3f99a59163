"""/v1/audio/transcriptions and /v1/audio/translations through the official OpenAI SDK, against
Whisper base on a real server."""

from __future__ import annotations

import base64
import io
import re
import wave
from types import SimpleNamespace

import httpx
import openai
import pytest
from audio_files import ENGLISH, GERMAN, NOT_AUDIO
from live_server import LiveServer
from openai import OpenAI

from modelhost.server.app import create_app
from modelhost.server.settings import ServeSettings

KEY_WORDS = ("purple", "umbrellas", "harbor", "tuesday")


def spoken(text: str) -> str:
    return text.lower()


def silence_wav(seconds: float) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(16_000)
        out.writeframes(b"\0\0" * int(16_000 * seconds))
    return buffer.getvalue()


def test_a_transcript_holds_the_words_that_were_spoken(client: OpenAI) -> None:
    result = client.audio.transcriptions.create(model="whisper-1", file=ENGLISH, language="en")
    for word in KEY_WORDS:
        assert word in spoken(result.text)


# This SDK marks `audio.translations` deprecated (OpenAI's newer models do not translate);
# Whisper still does, and clients still call it.
@pytest.mark.filterwarnings("ignore:deprecated:DeprecationWarning")
def test_a_translation_of_german_speech_is_english(client: OpenAI) -> None:
    result = client.audio.translations.create(model="whisper-1", file=GERMAN, temperature=0)
    assert "coffee" in spoken(result.text)


def test_verbose_json_detects_the_language_and_times_each_segment(client: OpenAI) -> None:
    result = client.audio.transcriptions.create(
        model="whisper-1", file=ENGLISH, response_format="verbose_json"
    )
    assert result.language == "english"
    assert result.duration == pytest.approx(4.86, abs=0.05)
    assert result.segments
    assert all(0 <= s.start < s.end <= result.duration + 0.5 for s in result.segments)
    assert "umbrellas" in spoken(" ".join(s.text for s in result.segments))
    assert result.words is None


def test_word_granularity_adds_a_timed_entry_for_each_word(client: OpenAI) -> None:
    result = client.audio.transcriptions.create(
        model="whisper-1",
        file=ENGLISH,
        language="en",
        response_format="verbose_json",
        timestamp_granularities=["word"],
    )
    words = [w.word.lower().strip(".,") for w in result.words or []]
    assert "umbrellas" in words
    assert all(w.start <= w.end for w in result.words or [])
    starts = [w.start for w in result.words or []]
    assert starts == sorted(starts)


def test_text_format_is_the_bare_transcript(client: OpenAI) -> None:
    text = client.audio.transcriptions.create(
        model="whisper-1", file=ENGLISH, language="en", response_format="text"
    )
    assert isinstance(text, str)
    assert "umbrellas" in spoken(text)
    assert not text.lstrip().startswith("{")


def test_srt_format_is_numbered_cues_with_comma_timestamps(client: OpenAI) -> None:
    srt = client.audio.transcriptions.create(
        model="whisper-1", file=ENGLISH, language="en", response_format="srt"
    )
    cue = re.compile(r"^1\n\d\d:\d\d:\d\d,\d{3} --> \d\d:\d\d:\d\d,\d{3}\n.*umbrellas", re.I)
    assert cue.search(srt)


def test_vtt_format_is_a_webvtt_document_with_dot_timestamps(client: OpenAI) -> None:
    vtt = client.audio.transcriptions.create(
        model="whisper-1", file=ENGLISH, language="en", response_format="vtt"
    )
    assert vtt.startswith("WEBVTT\n\n")
    assert re.search(r"\d\d:\d\d:\d\d\.\d{3} --> \d\d:\d\d:\d\d\.\d{3}\n.*umbrellas", vtt, re.I)


def test_streamed_deltas_concatenate_to_the_final_text(client: OpenAI) -> None:
    events = list(
        client.audio.transcriptions.create(
            model="whisper-1", file=ENGLISH, language="en", stream=True
        )
    )
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    done = [e for e in events if e.type == "transcript.text.done"]
    assert deltas and len(done) == 1 and events[-1] is done[0]
    assert "".join(deltas) == done[0].text
    assert "umbrellas" in spoken(done[0].text)


def test_a_json_body_may_carry_the_audio_as_a_data_url(server: LiveServer) -> None:
    encoded = base64.b64encode(ENGLISH.read_bytes()).decode()
    body = {"model": "whisper-1", "language": "en", "file": f"data:audio/ogg;base64,{encoded}"}
    response = httpx.post(f"{server.base_url}/v1/audio/transcriptions", json=body, timeout=60)
    assert response.status_code == 200
    assert "umbrellas" in spoken(response.json()["text"])


def test_stats_show_one_request_decoding_at_a_time(server: LiveServer) -> None:
    stats = httpx.get(f"{server.base_url}/stats").json()
    assert stats["server"]["model"] == "whisper-base"
    assert stats["batch"]["configured"] == 1


def test_a_file_declared_as_text_is_refused_with_415(client: OpenAI) -> None:
    with pytest.raises(openai.APIStatusError) as refused:
        client.audio.transcriptions.create(
            model="whisper-1", file=("notes.txt", NOT_AUDIO.read_bytes(), "text/plain")
        )
    assert refused.value.status_code == 415
    assert refused.value.body["code"] == "unsupported_media_type"  # type: ignore[index]


def test_bytes_that_do_not_decode_as_audio_are_refused_with_400(client: OpenAI) -> None:
    upload = ("clip.ogg", NOT_AUDIO.read_bytes(), "application/octet-stream")
    with pytest.raises(openai.BadRequestError) as refused:
        client.audio.transcriptions.create(model="whisper-1", file=upload)
    assert "could not decode" in refused.value.body["message"]  # type: ignore[index]
    assert refused.value.body["param"] == "file"  # type: ignore[index]


def test_a_clip_shorter_than_a_tenth_of_a_second_is_refused_with_400(client: OpenAI) -> None:
    upload = ("blip.wav", silence_wav(0.05), "audio/wav")
    with pytest.raises(openai.BadRequestError) as refused:
        client.audio.transcriptions.create(model="whisper-1", file=upload)
    assert "at least 0.1 s" in refused.value.body["message"]  # type: ignore[index]


def test_a_file_over_25_mb_is_refused_with_413(client: OpenAI) -> None:
    upload = ("long.wav", b"\0" * (25 * 1024 * 1024 + 1), "audio/wav")
    with pytest.raises(openai.APIStatusError) as refused:
        client.audio.transcriptions.create(model="whisper-1", file=upload)
    assert refused.value.status_code == 413


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("response_format", "docx"),
        ("temperature", "hot"),
        ("language", "klingon"),
        ("timestamp_granularities[]", "syllable"),
    ],
)
def test_a_bad_field_is_refused_with_400_naming_it(
    server: LiveServer, field: str, value: str
) -> None:
    response = httpx.post(
        f"{server.base_url}/v1/audio/transcriptions",
        data={"model": "whisper-1", field: value},
        files={"file": ("speech.ogg", ENGLISH.read_bytes(), "audio/ogg")},
        timeout=60,
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == field.removesuffix("[]")


def test_a_request_without_a_file_is_refused_with_400(server: LiveServer) -> None:
    response = httpx.post(
        f"{server.base_url}/v1/audio/transcriptions",
        data={"model": "whisper-1"},
        files={"other": ("x.bin", b"1", "application/octet-stream")},
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "file"


async def test_a_server_without_a_transcription_model_refuses_with_400() -> None:
    chat_only = SimpleNamespace(model_id="smollm2-135m-instruct", close=lambda: None)
    app = create_app(chat_only, ServeSettings())  # type: ignore[arg-type]
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
        response = await http.post(
            "/v1/audio/transcriptions",
            data={"model": "whisper-1"},
            files={"file": ("speech.ogg", ENGLISH.read_bytes(), "audio/ogg")},
        )
    assert response.status_code == 400
    assert "not a transcription model" in response.json()["error"]["message"]
