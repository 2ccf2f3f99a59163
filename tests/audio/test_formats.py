"""The five response formats, written from a known transcript."""

from __future__ import annotations

from modelhost.audio.formats import (
    Segment,
    Transcript,
    Word,
    language_code,
    render,
    timestamp,
)

WORDS = (Word(" Hello", 0.0, 0.4, 0.9), Word(" world.", 0.4, 1.0, 0.8))
TRANSCRIPT = Transcript(
    task="transcribe",
    language="en",
    duration=3661.5,
    segments=(
        Segment(id=0, seek=0, start=0.0, end=1.0, text=" Hello world.", words=WORDS),
        Segment(id=1, seek=0, start=3600.25, end=3661.5, text=" Goodbye."),
    ),
)


def test_json_is_the_text_and_the_seconds_billed_rounded_up() -> None:
    assert render(TRANSCRIPT, "json") == {
        "text": "Hello world. Goodbye.",
        "usage": {"type": "duration", "seconds": 3662},
    }


def test_text_is_the_transcript_on_one_line() -> None:
    assert render(TRANSCRIPT, "text") == "Hello world. Goodbye.\n"


def test_srt_numbers_its_cues_from_one_with_comma_milliseconds() -> None:
    assert render(TRANSCRIPT, "srt") == (
        "1\n00:00:00,000 --> 00:00:01,000\nHello world.\n\n"
        "2\n01:00:00,250 --> 01:01:01,500\nGoodbye.\n\n"
    )


def test_vtt_starts_with_its_header_and_uses_dot_milliseconds() -> None:
    assert render(TRANSCRIPT, "vtt") == (
        "WEBVTT\n\n"
        "00:00:00.000 --> 00:00:01.000\nHello world.\n\n"
        "01:00:00.250 --> 01:01:01.500\nGoodbye.\n\n"
    )


def test_verbose_json_names_the_language_and_lists_segments_without_words() -> None:
    body = render(TRANSCRIPT, "verbose_json")
    assert isinstance(body, dict)
    assert body["task"] == "transcribe"
    assert body["language"] == "english"
    assert body["duration"] == 3661.5
    assert [s["id"] for s in body["segments"]] == [0, 1]
    assert body["segments"][1]["text"] == " Goodbye."
    assert "words" not in body


def test_word_granularity_lists_words_without_their_leading_space() -> None:
    body = render(TRANSCRIPT, "verbose_json", ["word"])
    assert isinstance(body, dict)
    assert body["words"] == [
        {"word": "Hello", "start": 0.0, "end": 0.4},
        {"word": "world.", "start": 0.4, "end": 1.0},
    ]
    assert "segments" not in body


def test_both_granularities_give_segments_and_words() -> None:
    body = render(TRANSCRIPT, "verbose_json", ["segment", "word"])
    assert isinstance(body, dict)
    assert "segments" in body and "words" in body


def test_timestamps_round_to_the_millisecond() -> None:
    assert timestamp(59.9996, ".") == "00:01:00.000"
    assert timestamp(-0.2, ",") == "00:00:00,000"


def test_a_language_may_be_named_by_code_or_english_name() -> None:
    assert language_code("de") == "de"
    assert language_code("German") == "de"
    assert language_code("klingon") is None
