"""The inference stage: admit (400/429/501/503 before anything runs), then run once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
from scripted_engine import ScriptedEngine, scripted_model

from modelhost.inference.admission import AdmissionPolicy
from modelhost.inference.contracts import (
    ChatPrompt,
    ContextOverBudget,
    EngineUnavailable,
    InferenceRequest,
    InvalidRequest,
    QueueFullError,
    TextPrompt,
    UnsupportedExecution,
)
from modelhost.inference.defaults import ServingDefaults
from modelhost.inference.stage import InferenceStage


async def eventually(condition: Callable[[], bool], timeout_s: float = 2.0) -> bool:
    """Whether `condition` holds within `timeout_s` (a cancelled row leaves within a step)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.005)
    return True


def stage_over(engine: ScriptedEngine, **kwargs: object) -> InferenceStage:
    return InferenceStage(engine, scripted_model(), **kwargs)  # type: ignore[arg-type]


def text_request(text: str = "hi", **fields: object) -> InferenceRequest:
    return InferenceRequest(request_id="r1", method="text", prompt=TextPrompt(text), **fields)


def chat_request(**fields: object) -> InferenceRequest:
    prompt = ChatPrompt(messages=({"role": "user", "content": "hi"},))
    return InferenceRequest(request_id="r1", method="chat", prompt=prompt, **fields)


async def test_run_returns_the_whole_text_with_finish_reason_and_usage() -> None:
    admitted = await stage_over(ScriptedEngine(["a", "b"])).admit(text_request("hello"))
    result = await admitted.run()
    assert result.text == "ab"
    assert result.finish_reason == "stop"
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (5, 2)
    assert result.usage.total_tokens == 7
    assert result.logprobs is None


async def test_an_admitted_request_runs_only_once() -> None:
    admitted = await stage_over(ScriptedEngine()).admit(text_request())
    await admitted.run()
    with pytest.raises(RuntimeError, match="already been run"):
        await admitted.run()


async def test_events_end_with_one_terminal_event_carrying_usage() -> None:
    admitted = await stage_over(ScriptedEngine(["a", "b", "c"])).admit(text_request())
    events = [event async for event in admitted.events()]
    assert [event.text for event in events[:-1]] == ["a", "b", "c"]
    assert [event.is_terminal for event in events] == [False, False, False, True]
    assert events[-1].usage is not None and events[-1].usage.completion_tokens == 3


async def test_max_tokens_ends_the_row_with_length() -> None:
    admitted = await stage_over(ScriptedEngine(["a", "b", "c"])).admit(text_request(max_tokens=2))
    result = await admitted.run()
    assert (result.text, result.finish_reason) == ("ab", "length")


async def test_leaving_the_event_stream_early_cancels_the_engine_row() -> None:
    engine = ScriptedEngine(["a"] * 100, step_s=0.01)
    admitted = await stage_over(engine).admit(text_request())
    events = admitted.events()
    await anext(events)
    await events.aclose()
    assert engine.num_cancelled == 1
    assert await eventually(lambda: engine.stats().active_rows == 0)


async def test_a_full_queue_is_refused_with_429_queue_full() -> None:
    engine = ScriptedEngine(["a"] * 100, step_s=0.05, batch=1, max_queue=1)
    stage = stage_over(engine)
    await stage.admit(text_request())
    await stage.admit(text_request())
    with pytest.raises(QueueFullError) as refused:
        await stage.admit(text_request())
    assert refused.value.status == 429
    assert refused.value.body["code"] == "queue_full"
    engine.close()


async def test_a_prompt_over_the_context_window_is_refused_before_the_engine_sees_it() -> None:
    engine = ScriptedEngine()
    stage = stage_over(engine, policy=AdmissionPolicy(context_window=4))
    with pytest.raises(ContextOverBudget):
        await stage.admit(text_request("hello"))
    assert engine.submissions == []


async def test_requested_max_tokens_is_clamped_to_the_room_left() -> None:
    engine = ScriptedEngine()
    stage = stage_over(engine, policy=AdmissionPolicy(context_window=10))
    admitted = await stage.admit(text_request("hello", max_tokens=100))
    assert admitted.max_tokens == 5
    assert engine.submissions[0].params.max_tokens == 5


async def test_the_serve_max_tokens_applies_when_the_request_sets_none() -> None:
    engine = ScriptedEngine()
    stage = stage_over(engine, defaults=ServingDefaults(max_tokens=3))
    admitted = await stage.admit(text_request())
    assert admitted.max_tokens == 3


async def test_an_unplaceable_shape_is_refused_before_the_prompt_is_built() -> None:
    engine = ScriptedEngine()
    with pytest.raises(UnsupportedExecution):
        await stage_over(engine).admit(text_request(num_choices=3))
    assert engine.submissions == []


async def test_a_closed_engine_answers_503() -> None:
    engine = ScriptedEngine()
    engine.close()
    with pytest.raises(EngineUnavailable) as refused:
        await stage_over(engine).admit(text_request())
    assert refused.value.status == 503


async def test_a_template_failure_is_a_400_prompt_build_failed() -> None:
    bad = ChatPrompt(messages=({"role": "user", "content": ["not", "text"]},))
    request = InferenceRequest(request_id="r", method="chat", prompt=bad)
    with pytest.raises(InvalidRequest, match="^prompt build failed: "):
        await stage_over(ScriptedEngine()).admit(request)


async def test_chat_prompts_render_through_the_model_template() -> None:
    engine = ScriptedEngine()
    stage = stage_over(engine)
    await stage.admit(chat_request())
    rendered = stage.model.tokenizer.decode(engine.submissions[0].prompt_ids, False)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


async def test_structured_output_is_injected_as_a_system_instruction_with_a_warning() -> None:
    engine = ScriptedEngine()
    stage = stage_over(engine)
    admitted = await stage.admit(chat_request(structured_output="Respond only with JSON."))
    rendered = stage.model.tokenizer.decode(engine.submissions[0].prompt_ids, False)
    assert rendered.startswith("<|im_start|>system\nRespond only with JSON.<|im_end|>")
    assert admitted.warnings and admitted.warnings[0].startswith("grammar not enforced")


async def test_logprobs_are_collected_when_asked_for() -> None:
    admitted = await stage_over(ScriptedEngine(["a", "b"])).admit(text_request(logprobs=2))
    result = await admitted.run()
    assert result.logprobs is not None
    assert [lp.token for lp in result.logprobs] == ["a", "b"]
    assert all(len(lp.top) == 2 for lp in result.logprobs)


async def test_stats_count_running_rows_and_report_the_enforced_context() -> None:
    engine = ScriptedEngine(["a"] * 100, step_s=0.01)
    stage = stage_over(engine, policy=AdmissionPolicy(context_window=512))
    admitted = await stage.admit(text_request())
    events = admitted.events()
    await anext(events)
    assert stage.stats().batch.active_rows == 1
    assert stage.stats().admission.enforced_context_tokens == 512
    await events.aclose()
    assert await eventually(lambda: stage.stats().batch.active_rows == 0)


async def test_closing_the_stage_ends_a_running_request_with_503_without_waiting_for_a_step() -> (
    None
):
    engine = ScriptedEngine(["a", "b"], stall_after=1, stall_s=60)
    stage = stage_over(engine)
    admitted = await stage.admit(text_request())
    events = admitted.events()
    await anext(events)
    stage.close()
    with pytest.raises(EngineUnavailable) as ended:
        await asyncio.wait_for(anext(events), timeout=1)
    assert ended.value.status == 503
    assert ended.value.body["code"] == "closed"


async def test_closing_the_stage_from_another_thread_ends_its_requests() -> None:
    engine = ScriptedEngine(["a", "b"], stall_after=1, stall_s=60)
    stage = stage_over(engine)
    admitted = await stage.admit(text_request())
    running = asyncio.ensure_future(admitted.run())
    await asyncio.sleep(0.01)
    await asyncio.to_thread(stage.close)
    with pytest.raises(EngineUnavailable):
        await asyncio.wait_for(running, timeout=1)


async def test_a_request_its_caller_cancels_as_the_stage_closes_ends_cancelled() -> None:
    engine = ScriptedEngine(["a", "b"], stall_after=1, stall_s=60)
    stage = stage_over(engine)
    admitted = await stage.admit(text_request())
    running = asyncio.ensure_future(admitted.run())
    await asyncio.sleep(0.01)
    running.cancel()
    stage.close()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(running, timeout=1)


async def test_a_closed_stage_refuses_new_requests_with_503() -> None:
    stage = stage_over(ScriptedEngine())
    await stage.admit(text_request())
    stage.close()
    with pytest.raises(EngineUnavailable):
        await stage.admit(text_request())
