"""The transcription stage: one request at a time, deltas per segment, and early stops."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from scripted_whisper import ONE_SECOND, ScriptedWhisper, stage_over

from modelhost.audio import transcriber as stage_module
from modelhost.audio.transcriber import TranscriptionStage
from modelhost.inference.contracts import EngineUnavailable, InvalidRequest, QueueFullError


async def test_a_transcript_joins_its_segments_without_the_leading_space() -> None:
    stage = stage_over(ScriptedWhisper([" Hello", " world."]))
    transcript = await stage.transcribe(ONE_SECOND)
    assert transcript.text == "Hello world."
    assert [s.id for s in transcript.segments] == [0, 1]
    stage.close()


async def test_a_stream_yields_each_segment_as_a_delta_that_joins_to_the_text() -> None:
    stage = stage_over(ScriptedWhisper([" Hello", " world."]))
    deltas = [delta async for delta in await stage.stream(ONE_SECOND)]
    assert deltas == ["Hello", " world."]
    stage.close()


async def test_closing_a_stream_early_stops_decoding_at_the_next_segment() -> None:
    gate = threading.Event()
    model = ScriptedWhisper([" one", " two", " three", " four", " five"], gate)
    stage = stage_over(model)
    deltas = await stage.stream(ONE_SECOND)
    assert await anext(deltas) == "one"
    await deltas.aclose()  # type: ignore[attr-defined]
    gate.set()
    model.texts = [" next"]
    assert (await stage.transcribe(ONE_SECOND)).text == "next"  # runs once the first stopped
    assert model.pulled == 2 + 1  # the first request stopped after its second segment
    stage.close()


async def test_requests_are_decoded_one_at_a_time() -> None:
    gate = threading.Event()
    model = ScriptedWhisper([" a", " b"], gate)
    stage = stage_over(model)
    runs = [asyncio.create_task(stage.transcribe(ONE_SECOND)) for _ in range(3)]
    await asyncio.sleep(0.1)
    gate.set()
    assert [r.text for r in await asyncio.gather(*runs)] == ["a b"] * 3
    assert model.most_running == 1
    stage.close()


async def test_a_request_cancelled_while_it_waits_never_reaches_the_model() -> None:
    gate = threading.Event()
    model = ScriptedWhisper([" a", " b"], gate)
    stage = stage_over(model)
    first = asyncio.create_task(stage.transcribe(ONE_SECOND))
    await asyncio.sleep(0.1)
    waiting = asyncio.create_task(stage.transcribe(ONE_SECOND))
    await asyncio.sleep(0.05)
    waiting.cancel()
    await asyncio.sleep(0.05)  # the cancellation reaches the stage
    gate.set()
    await first
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert model.calls == 1
    stage.close()


async def test_a_closed_stage_refuses_requests_with_503_and_holds_no_memory() -> None:
    stage = stage_over(ScriptedWhisper([" a"]))
    assert stage.resident_bytes() > 1000
    stage.close()
    with pytest.raises(EngineUnavailable) as refused:
        await stage.transcribe(ONE_SECOND)
    assert refused.value.status == 503
    assert stage.resident_bytes() == 0


def test_a_language_the_model_does_not_know_is_a_400_on_language() -> None:
    stage = stage_over(ScriptedWhisper([" a"]))
    with pytest.raises(InvalidRequest) as refused:
        stage.options(language="fr")
    assert refused.value.param == "language"
    assert stage.options(language="German").language == "de"
    stage.close()


def test_whisper_base_counts_its_weights_and_working_memory(
    transcriber: TranscriptionStage, whisper_dir: Path
) -> None:
    weights = (whisper_dir / "model.bin").stat().st_size
    assert weights < transcriber.resident_bytes() < 2 * weights


async def test_a_request_beyond_the_queue_bound_is_refused_with_429(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(stage_module, "MAX_QUEUE", 1)
    gate = threading.Event()
    stage = stage_over(ScriptedWhisper([" a", " b"], gate))
    held = [asyncio.create_task(stage.transcribe(ONE_SECOND)) for _ in range(2)]
    await asyncio.sleep(0.1)
    with pytest.raises(QueueFullError) as refused:
        await stage.transcribe(ONE_SECOND)
    assert refused.value.status == 429
    gate.set()
    await asyncio.gather(*held)
    stage.close()
