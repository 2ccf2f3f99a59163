"""OpenAI audio: `POST /v1/audio/transcriptions` and `POST /v1/audio/translations`.

The audio comes as the multipart `file` part (what OpenAI's clients send), as `file` in a JSON
body (base64, or a `data:` URL), or as the raw body with an audio content type (fields then in
the query string). Fields: `model`, `language`, `prompt`, `temperature`, `response_format`
(json, text, srt, verbose_json, vtt), `timestamp_granularities[]` (segment, word), `stream`
and `beam_size`. A stream sends `transcript.text.delta` events as Whisper decodes each segment,
then one `transcript.text.done` with the whole text.

Refusals, in OpenAI's error shape: 400 for a bad field, audio that does not decode or a clip
under 0.1 s; 413 over the audio cap (`ServeSettings.max_audio_bytes`, 25 MB by default); 415
for a file whose declared type is not audio; 499 when the client leaves (the decoding stops at
the next segment).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from starlette.datastructures import Headers, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from modelhost.audio.decode import decode_audio
from modelhost.audio.formats import GRANULARITIES, RESPONSE_FORMATS, render
from modelhost.audio.transcriber import (
    DEFAULT_BEAM_SIZE,
    TranscriptDeltas,
    TranscriptionFields,
    TranscriptionStage,
)
from modelhost.inference.contracts import InvalidRequest, RequestCancelled, RequestError
from modelhost.server.http import (
    SSE_HEADERS,
    STAGE_KEY,
    EventStreamResponse,
    RequestLog,
    error_response,
    error_status_body,
    wait_for_disconnect,
)
from modelhost.server.openai.wire import new_id, openai_error, openai_stream_error, sse

MAX_AUDIO_BYTES = 25 * 1024 * 1024  # OpenAI's own cap on one upload; `max_audio_bytes` wins
_FIELDS_ALLOWANCE = 1024 * 1024  # the multipart or JSON wrapping around the audio
_DRAIN_FACTOR = 4  # an oversize body is read (and dropped) up to this many caps, then cut off
# Declared types that can carry audio; anything else named for the file is a 415.
_CONTAINER_TYPES = ("application/octet-stream", "application/ogg", "binary/octet-stream")


@dataclass(frozen=True, slots=True)
class AudioRequest:
    data: bytes
    fields: Mapping[str, Any]  # JSON values, or strings (repeated form keys as lists)


@dataclass(frozen=True, slots=True)
class AudioParams:
    response_format: str
    granularities: tuple[str, ...]
    stream: bool
    language: str | None
    prompt: str | None
    temperature: float | None
    beam_size: int


class PayloadTooLarge(RequestError):
    def __init__(self, cap: int) -> None:
        message = f"the audio file is larger than the server's limit of {cap} bytes"
        body = {"message": message, "type": "invalid_request_error", "code": "file_too_large"}
        super().__init__(413, message, body)


class UnsupportedMediaType(RequestError):
    def __init__(self, content_type: str) -> None:
        message = f"unsupported content type {content_type!r}: send an audio file"
        body = {
            "message": message,
            "type": "invalid_request_error",
            "code": "unsupported_media_type",
            "param": "file",
        }
        super().__init__(415, message, body)


async def create_transcription(request: Request) -> Response | EventStreamResponse:
    return await _respond(request, "transcribe", "POST /v1/audio/transcriptions")


async def create_translation(request: Request) -> Response | EventStreamResponse:
    return await _respond(request, "translate", "POST /v1/audio/translations")


def transcriber(request: Request) -> TranscriptionStage:
    """The stage that answers: the one the leasing middleware leased for this request, else the
    app's own transcriber (`app.state.transcriber`, or a single-model app's `stage`)."""
    state = request.app.state
    for stage in (
        request.scope.get(STAGE_KEY),
        getattr(state, "transcriber", None),
        getattr(state, "stage", None),
    ):
        if isinstance(stage, TranscriptionStage):
            return stage
    served = request.scope.get(STAGE_KEY) or getattr(state, "stage", None)
    name = getattr(served, "model_id", "this server's model")
    raise InvalidRequest(f'model "{name}" is not a transcription model', param="model")


async def _respond(request: Request, task: str, route: str) -> Response | EventStreamResponse:
    log = RequestLog(new_id("audio"), route)
    try:
        upload = await read_audio_request(request)
        params = parse_params(upload.fields, task)
        stage = transcriber(request)
        arguments: TranscriptionFields = {
            "task": task,
            "language": params.language,
            "prompt": params.prompt,
            "temperature": params.temperature,
            "word_timestamps": "word" in params.granularities,
            "beam_size": params.beam_size,
        }
        stage.options(**arguments)  # a bad field is a 400 before the audio is decoded
        samples = await asyncio.to_thread(decode_audio, upload.data)
        if params.stream:
            deltas = await stage.stream(samples, **arguments)
            return _event_stream(request, deltas, log)
        transcript = await _unless_client_leaves(request, stage.transcribe(samples, **arguments))
    except Exception as exc:
        return error_response(exc, log.request_id, openai_error, log)
    log.finish(200)
    body = render(transcript, params.response_format, params.granularities)
    if isinstance(body, str):
        return PlainTextResponse(body)
    return JSONResponse(body)


# ---------------------------------------------------------------------------------------------
# Reading the request


async def read_audio_request(request: Request) -> AudioRequest:
    """The audio bytes and the other fields, from a multipart, JSON or raw audio body."""
    cap = audio_cap(request)
    content_type = _media_type(request.headers.get("content-type", ""))
    wrapped = content_type in ("multipart/form-data", "application/json", "")
    if not wrapped and not _is_audio_type(content_type):
        raise UnsupportedMediaType(content_type)
    body = await _read_body(request, cap)
    if content_type == "multipart/form-data":
        return await _from_multipart(request.headers, body, cap)
    if content_type in ("application/json", ""):
        return _from_json(body, cap)
    fields: dict[str, Any] = {}
    for key, value in request.query_params.multi_items():
        _add_field(fields, key, value)
    return AudioRequest(_capped(body, cap), fields)


def audio_cap(request: Request) -> int:
    """The largest audio file this server takes: `ServeSettings.max_audio_bytes`, else 25 MB."""
    settings = getattr(request.app.state, "settings", None)
    return int(getattr(settings, "max_audio_bytes", None) or MAX_AUDIO_BYTES)


async def _read_body(request: Request, cap: int) -> bytes:
    """The body, up to what `cap` bytes of audio need (base64 in JSON the most); a longer one
    is read to its end, so the client gets to read the answer, and refused with 413. Past
    _DRAIN_FACTOR times that, the server stops reading."""
    limit = cap * 4 // 3 + _FIELDS_ALLOWANCE
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > _DRAIN_FACTOR * limit:
        raise PayloadTooLarge(cap)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size <= limit:
                chunks.append(chunk)
            elif size > _DRAIN_FACTOR * limit:
                break
    except ClientDisconnect:
        raise RequestCancelled() from None
    if size > limit:
        raise PayloadTooLarge(cap)
    return b"".join(chunks)


async def _from_multipart(headers: Headers, body: bytes, cap: int) -> AudioRequest:
    async def once() -> AsyncGenerator[bytes, None]:
        yield body

    parser = MultiPartParser(headers, once(), max_files=4, max_fields=64)
    try:
        form = await parser.parse()
    except MultiPartException as exc:
        raise InvalidRequest(f"malformed multipart body: {exc.message}") from None
    try:
        fields: dict[str, Any] = {}
        upload: UploadFile | None = None
        for key, value in form.multi_items():
            if isinstance(value, UploadFile):
                if key == "file":
                    upload = value
            else:
                _add_field(fields, key, value)
        if upload is None:
            raise InvalidRequest("`file` is required: the audio to transcribe", param="file")
        declared = _media_type(upload.content_type or "")
        if declared and not _is_audio_type(declared):
            raise UnsupportedMediaType(declared)
        data = await upload.read()
    finally:
        await form.close()
    return AudioRequest(_capped(data, cap), fields)


def _from_json(body: bytes, cap: int) -> AudioRequest:
    try:
        fields = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise InvalidRequest("invalid JSON body") from None
    if not isinstance(fields, dict):
        raise InvalidRequest("invalid JSON body")
    encoded = fields.get("file")
    if not isinstance(encoded, str) or not encoded:
        message = "`file` is required: the audio as base64 or a data: URL"
        raise InvalidRequest(message, param="file")
    if encoded.startswith("data:"):
        header, comma, encoded = encoded.partition(",")
        declared = _media_type(header.removeprefix("data:").split(";")[0])
        if not comma or ";base64" not in header:
            raise InvalidRequest("`file` must be a base64 data: URL", param="file")
        if declared and not _is_audio_type(declared):
            raise UnsupportedMediaType(declared)
    try:
        data = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest("`file` is not valid base64", param="file") from None
    return AudioRequest(_capped(data, cap), fields)


def _add_field(fields: dict[str, Any], key: str, value: str) -> None:
    """Form fields: repeated keys (and `name[]` keys) gather into lists."""
    if key.endswith("[]"):
        fields.setdefault(key[:-2], []).append(value)
    elif key in fields:
        existing = fields[key]
        fields[key] = [*existing, value] if isinstance(existing, list) else [existing, value]
    else:
        fields[key] = value


def _capped(data: bytes, cap: int) -> bytes:
    if len(data) > cap:
        raise PayloadTooLarge(cap)
    return data


def _media_type(value: str) -> str:
    return value.split(";")[0].strip().lower()


def _is_audio_type(media_type: str) -> bool:
    major = media_type.split("/")[0]
    return major in ("audio", "video") or media_type in _CONTAINER_TYPES


# ---------------------------------------------------------------------------------------------
# Fields


def parse_params(fields: Mapping[str, Any], task: str) -> AudioParams:
    """The request's options, each checked; a bad one is a 400 naming it."""
    response_format = _text(fields, "response_format") or "json"
    if response_format not in RESPONSE_FORMATS:
        message = f"response_format must be one of {', '.join(RESPONSE_FORMATS)}"
        raise InvalidRequest(message, param="response_format")
    granularities = _granularities(fields.get("timestamp_granularities"))
    temperature = _number(fields, "temperature")
    beam_size = _number(fields, "beam_size")
    if beam_size is not None and beam_size != int(beam_size):
        raise InvalidRequest("beam_size must be an integer", param="beam_size")
    return AudioParams(
        response_format=response_format,
        granularities=granularities,
        stream=_flag(fields, "stream"),
        language=_text(fields, "language"),
        prompt=_text(fields, "prompt"),
        temperature=temperature,
        beam_size=DEFAULT_BEAM_SIZE if beam_size is None else int(beam_size),
    )


def _text(fields: Mapping[str, Any], name: str) -> str | None:
    value = fields.get(name)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise InvalidRequest(f"{name} must be a string", param=name)
    return value


def _number(fields: Mapping[str, Any], name: str) -> float | None:
    value = fields.get(name)
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        raise InvalidRequest(f"{name} must be a number", param=name)
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise InvalidRequest(f"{name} must be a number", param=name) from None
    if not np.isfinite(number):
        raise InvalidRequest(f"{name} must be a finite number", param=name)
    return number


def _flag(fields: Mapping[str, Any], name: str) -> bool:
    value = fields.get(name)
    if value is None or value is False or value in ("false", "False", "0", ""):
        return False
    if value is True or value in ("true", "True", "1"):
        return True
    raise InvalidRequest(f"{name} must be true or false", param=name)


def _granularities(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    for item in values:
        if item not in GRANULARITIES:
            message = f"timestamp_granularities must hold {' or '.join(GRANULARITIES)}"
            raise InvalidRequest(message, param="timestamp_granularities")
    return tuple(dict.fromkeys(values))


# ---------------------------------------------------------------------------------------------
# Answering


async def _unless_client_leaves(request: Request, work: Any) -> Any:
    """`work`'s result; a client that leaves first cancels it (and the decoding stops)."""
    run = asyncio.ensure_future(work)
    gone = asyncio.create_task(wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({run, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not run.done():
            raise RequestCancelled()
        return run.result()
    finally:
        for task in (run, gone):
            task.cancel()
        await asyncio.wait({run, gone})


def _event_stream(
    request: Request, deltas: TranscriptDeltas, log: RequestLog
) -> EventStreamResponse:
    """SSE as OpenAI streams a transcript: `transcript.text.delta` events, then one
    `transcript.text.done`; a failure after the stream opened is one `{error}` event."""

    async def frames() -> AsyncIterator[str]:
        text = ""
        try:
            async for delta in deltas:
                text += delta
                yield sse({"type": "transcript.text.delta", "delta": delta})
            yield sse({"type": "transcript.text.done", "text": text})
            log.status_hint = 200
        except Exception as exc:
            status, body = error_status_body(exc, log.request_id, client_gone=False)
            log.status_hint = status
            yield openai_stream_error(status, body)
        finally:
            await deltas.aclose()

    def done(status: int | None) -> None:
        deltas.stop()  # now: the frames are closed only after the writer's task unwinds
        log.finish(log.status_hint if status is None else status)

    heartbeat_s: float = request.app.state.settings.heartbeat_s
    return EventStreamResponse(frames(), heartbeat_s=heartbeat_s, headers=SSE_HEADERS, on_done=done)
