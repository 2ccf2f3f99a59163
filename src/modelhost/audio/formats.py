"""A transcript and its five response formats: json, text, srt, verbose_json and vtt.

The shapes follow OpenAI's `/v1/audio/transcriptions`: `json` is `{text, usage}`, `text` the bare
text, `srt` and `vtt` one numbered or timed cue per segment, and `verbose_json` adds the task,
the language's English name, the duration, `segments` (unless only word timestamps were asked
for) and `words` (when they were).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

RESPONSE_FORMATS = ("json", "text", "srt", "verbose_json", "vtt")
GRANULARITIES = ("segment", "word")


@dataclass(frozen=True, slots=True)
class Word:
    word: str  # as the model spelled it, with its leading space
    start: float
    end: float
    probability: float


@dataclass(frozen=True, slots=True)
class Segment:
    id: int
    seek: int
    start: float
    end: float
    text: str  # with its leading space, as Whisper writes it
    tokens: tuple[int, ...] = ()
    temperature: float = 0.0
    avg_logprob: float = 0.0
    compression_ratio: float = 0.0
    no_speech_prob: float = 0.0
    words: tuple[Word, ...] = ()


@dataclass(frozen=True, slots=True)
class Transcript:
    task: str  # "transcribe" or "translate"
    language: str  # the code Whisper detected or was given: "en", "de", ...
    duration: float  # seconds of audio
    segments: tuple[Segment, ...]

    @property
    def text(self) -> str:
        return "".join(segment.text for segment in self.segments).strip()


def render(
    transcript: Transcript, response_format: str, granularities: Sequence[str] = ()
) -> dict[str, Any] | str:
    """The response body: a JSON object for json/verbose_json, else text."""
    if response_format == "json":
        return {"text": transcript.text, "usage": usage_json(transcript)}
    if response_format == "verbose_json":
        return verbose_json(transcript, granularities)
    if response_format == "text":
        return transcript.text + "\n"
    if response_format == "srt":
        return srt(transcript.segments)
    if response_format == "vtt":
        return vtt(transcript.segments)
    raise ValueError(f"unknown response_format {response_format!r}")


def usage_json(transcript: Transcript) -> dict[str, Any]:
    """OpenAI bills Whisper by the second of audio, rounded up."""
    return {"type": "duration", "seconds": math.ceil(transcript.duration)}


def verbose_json(transcript: Transcript, granularities: Sequence[str] = ()) -> dict[str, Any]:
    body: dict[str, Any] = {
        "task": transcript.task,
        "language": language_name(transcript.language),
        "duration": round(transcript.duration, 3),
        "text": transcript.text,
    }
    if "segment" in granularities or "word" not in granularities:
        body["segments"] = [_segment_json(segment) for segment in transcript.segments]
    if "word" in granularities:
        body["words"] = [
            {"word": word.word.strip(), "start": word.start, "end": word.end}
            for segment in transcript.segments
            for word in segment.words
        ]
    body["usage"] = usage_json(transcript)
    return body


def srt(segments: Sequence[Segment]) -> str:
    cues = [
        f"{number}\n{timestamp(s.start, ',')} --> {timestamp(s.end, ',')}\n{s.text.strip()}\n"
        for number, s in enumerate(segments, start=1)
    ]
    return "\n".join(cues) + ("\n" if cues else "")


def vtt(segments: Sequence[Segment]) -> str:
    cues = [
        f"{timestamp(s.start, '.')} --> {timestamp(s.end, '.')}\n{s.text.strip()}\n"
        for s in segments
    ]
    return "WEBVTT\n\n" + "\n".join(cues) + ("\n" if cues else "")


def timestamp(seconds: float, decimal_marker: str) -> str:
    """`HH:MM:SS<marker>mmm`, as SRT (`,`) and WebVTT (`.`) write times."""
    millis = round(max(seconds, 0.0) * 1000)
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{decimal_marker}{millis:03d}"


def language_name(code: str) -> str:
    """OpenAI names the language in English words (`english`); an unknown code stays as is."""
    return LANGUAGES.get(code, code)


def language_code(value: str) -> str | None:
    """A request's `language` (an ISO-639-1 code or an English name) as Whisper's code."""
    lowered = value.strip().lower()
    if lowered in LANGUAGES:
        return lowered
    return _CODES_BY_NAME.get(lowered)


def _segment_json(segment: Segment) -> dict[str, Any]:
    return {
        "id": segment.id,
        "seek": segment.seek,
        "start": segment.start,
        "end": segment.end,
        "text": segment.text,
        "tokens": list(segment.tokens),
        "temperature": segment.temperature,
        "avg_logprob": segment.avg_logprob,
        "compression_ratio": segment.compression_ratio,
        "no_speech_prob": segment.no_speech_prob,
    }


# Whisper's languages, code to English name (the table the model was trained with).
LANGUAGES = {
    "en": "english",
    "zh": "chinese",
    "de": "german",
    "es": "spanish",
    "ru": "russian",
    "ko": "korean",
    "fr": "french",
    "ja": "japanese",
    "pt": "portuguese",
    "tr": "turkish",
    "pl": "polish",
    "ca": "catalan",
    "nl": "dutch",
    "ar": "arabic",
    "sv": "swedish",
    "it": "italian",
    "id": "indonesian",
    "hi": "hindi",
    "fi": "finnish",
    "vi": "vietnamese",
    "he": "hebrew",
    "uk": "ukrainian",
    "el": "greek",
    "ms": "malay",
    "cs": "czech",
    "ro": "romanian",
    "da": "danish",
    "hu": "hungarian",
    "ta": "tamil",
    "no": "norwegian",
    "th": "thai",
    "ur": "urdu",
    "hr": "croatian",
    "bg": "bulgarian",
    "lt": "lithuanian",
    "la": "latin",
    "mi": "maori",
    "ml": "malayalam",
    "cy": "welsh",
    "sk": "slovak",
    "te": "telugu",
    "fa": "persian",
    "lv": "latvian",
    "bn": "bengali",
    "sr": "serbian",
    "az": "azerbaijani",
    "sl": "slovenian",
    "kn": "kannada",
    "et": "estonian",
    "mk": "macedonian",
    "br": "breton",
    "eu": "basque",
    "is": "icelandic",
    "hy": "armenian",
    "ne": "nepali",
    "mn": "mongolian",
    "bs": "bosnian",
    "kk": "kazakh",
    "sq": "albanian",
    "sw": "swahili",
    "gl": "galician",
    "mr": "marathi",
    "pa": "punjabi",
    "si": "sinhala",
    "km": "khmer",
    "sn": "shona",
    "yo": "yoruba",
    "so": "somali",
    "af": "afrikaans",
    "oc": "occitan",
    "ka": "georgian",
    "be": "belarusian",
    "tg": "tajik",
    "sd": "sindhi",
    "gu": "gujarati",
    "am": "amharic",
    "yi": "yiddish",
    "lo": "lao",
    "uz": "uzbek",
    "fo": "faroese",
    "ht": "haitian creole",
    "ps": "pashto",
    "tk": "turkmen",
    "nn": "nynorsk",
    "mt": "maltese",
    "sa": "sanskrit",
    "lb": "luxembourgish",
    "my": "myanmar",
    "bo": "tibetan",
    "tl": "tagalog",
    "mg": "malagasy",
    "as": "assamese",
    "tt": "tatar",
    "haw": "hawaiian",
    "ln": "lingala",
    "ha": "hausa",
    "ba": "bashkir",
    "jw": "javanese",
    "su": "sundanese",
    "yue": "cantonese",
}
_CODES_BY_NAME = {name: code for code, name in LANGUAGES.items()}
