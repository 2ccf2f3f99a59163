"""The engine end to end on the real SmolLM2: batching, prefix reuse, cancellation, limits."""

from __future__ import annotations

import asyncio
import sys
import threading

import pytest
import torch

from modelhost.engine.engine import Engine, EngineConfig
from modelhost.engine.events import EngineEvent, PromptTooLong, QueueFull
from modelhost.engine.sampling.sampling_params import SamplingParams
from modelhost.engine.scheduler import ScheduledRow
from modelhost.engine.sequence import Sequence
from modelhost.models.batch import ForwardBatch
from modelhost.models.loaded import LoadedModel

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
    "My favourite book is",
    "In 1969, the first humans",
    "A good breakfast includes",
]


@pytest.fixture
def engine(smollm2: LoadedModel):
    engine = Engine(smollm2, EngineConfig(batch=8))
    yield engine
    engine.close()


async def collect(engine: Engine, prompt_ids: list[int], params: SamplingParams):
    events: list[EngineEvent] = [event async for event in engine.submit(prompt_ids, params)]
    tokens = [token for event in events for token in event.token_ids]
    return tokens, "".join(event.text for event in events), events[-1]


async def wait_until_idle(engine: Engine) -> None:
    for _ in range(200):
        stats = engine.stats()
        if stats.active_rows == 0 and stats.pending_rows == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine still busy: {engine.stats()}")


async def test_engine_answers_paris_when_asked_the_capital_of_france(engine, smollm2):
    prompt = smollm2.tokenizer.encode_chat(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    _, text, last = await collect(engine, prompt, SamplingParams(temperature=0, max_tokens=32))
    assert text == "The capital of France is Paris."
    assert last.finish_reason == "stop"


async def test_engine_greedy_outputs_of_eight_prompts_run_together_equal_each_run_alone(
    engine, smollm2
):
    prompts = [smollm2.tokenizer.encode(p) for p in PROMPTS]
    alone = [(await collect(engine, p, GREEDY))[0] for p in prompts]
    together = await asyncio.gather(*(collect(engine, p, GREEDY) for p in prompts))
    assert [tokens for tokens, _, _ in together] == alone


async def test_engine_same_seed_gives_same_tokens_whatever_is_batched_with_it(engine, smollm2):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20)
    prompt = smollm2.tokenizer.encode("Write a short poem about the sea.")
    alone, _, _ = await collect(engine, prompt, params)
    others = [smollm2.tokenizer.encode(p) for p in PROMPTS[:5]]
    crowd = [collect(engine, p, SamplingParams(temperature=1.0, max_tokens=20)) for p in others]
    results = await asyncio.gather(collect(engine, prompt, params), *crowd)
    assert results[0][0] == alone


async def test_engine_different_seeds_give_different_samples(engine, smollm2):
    prompt = smollm2.tokenizer.encode("Tell me a random word:")
    # a handful of tokens: two seeds agreeing on all of them at temperature 1.5 is negligible
    first, _, _ = await collect(
        engine, prompt, SamplingParams(temperature=1.5, seed=1, max_tokens=8)
    )
    second, _, _ = await collect(
        engine, prompt, SamplingParams(temperature=1.5, seed=2, max_tokens=8)
    )
    assert first != second


async def test_engine_reports_cached_tokens_when_a_prompt_shares_a_full_block_prefix(
    engine, smollm2
):
    shared = smollm2.tokenizer.encode("You are a careful assistant. " * 12)
    first = shared + smollm2.tokenizer.encode(" Question one?")
    second = shared + smollm2.tokenizer.encode(" Another question entirely?")
    _, _, last_first = await collect(engine, first, GREEDY)
    _, _, last_second = await collect(engine, second, GREEDY)
    block = engine.config.block_size
    assert last_first.usage.cached_tokens == 0
    assert last_second.usage.cached_tokens == (len(shared) // block) * block
    assert last_second.usage.cached_tokens > 0


async def test_engine_second_run_of_a_cached_prompt_gives_the_same_greedy_tokens(engine, smollm2):
    prompt = smollm2.tokenizer.encode("The history of the Roman Empire begins " * 6)
    cold, _, _ = await collect(engine, prompt, GREEDY)
    warm, _, last = await collect(engine, prompt, GREEDY)
    assert last.usage.cached_tokens > 0
    assert warm == cold


async def test_engine_cancelled_stream_frees_its_row_and_blocks(engine, smollm2):
    baseline = engine.stats().kv_blocks_used
    stream = engine.submit(
        smollm2.tokenizer.encode("Count to one thousand:"),
        SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True),
    )
    received = 0
    async for event in stream:
        received += len(event.token_ids)
        if received >= 3:
            break
    stream.cancel()
    await wait_until_idle(engine)
    assert engine.stats().kv_blocks_used == baseline
    engine.block_manager.check_invariants()


async def test_engine_refuses_at_once_with_queue_full_when_the_queue_is_at_its_bound(smollm2):
    engine = Engine(smollm2, EngineConfig(batch=1, max_queue=1))
    try:
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        prompt = smollm2.tokenizer.encode("Hello")
        first = engine.submit(prompt, params)
        second = engine.submit(prompt, params)
        with pytest.raises(QueueFull):
            engine.submit(prompt, params)
        first.cancel()
        second.cancel()
    finally:
        engine.close()


async def test_engine_refuses_a_prompt_that_fills_the_context(smollm2):
    engine = Engine(smollm2, EngineConfig(context_length=64))
    try:
        with pytest.raises(PromptTooLong):
            engine.submit(list(range(100, 164)), GREEDY)
    finally:
        engine.close()


async def test_engine_clamps_output_to_the_context_left(smollm2):
    engine = Engine(smollm2, EngineConfig(context_length=40))
    try:
        prompt = smollm2.tokenizer.encode("Tell me a very long story about dragons.")
        params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
        tokens, _, last = await collect(engine, prompt, params)
        assert len(prompt) + len(tokens) == 40
        assert last.finish_reason == "length"
    finally:
        engine.close()


async def test_engine_never_emits_a_stop_string_and_reports_it(engine, smollm2):
    prompt = smollm2.tokenizer.encode_chat(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    params = SamplingParams(temperature=0, max_tokens=32, stop=("Paris",))
    _, text, last = await collect(engine, prompt, params)
    assert text == "The capital of France is "
    assert last.finish_reason == "stop"
    assert last.stop_string == "Paris"


async def test_engine_finishes_with_length_at_max_tokens_and_usage_adds_up(engine, smollm2):
    prompt = smollm2.tokenizer.encode("The three primary colors are")
    tokens, _, last = await collect(engine, prompt, GREEDY)
    assert last.finish_reason == "length"
    assert len(tokens) == GREEDY.max_tokens
    assert last.usage.prompt_tokens == len(prompt)
    assert last.usage.completion_tokens == len(tokens)


async def test_engine_returns_logprobs_with_alternatives_when_asked(engine, smollm2):
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True)
    stream = engine.submit(smollm2.tokenizer.encode("The capital of France is"), params)
    events = [event async for event in stream]
    logprobs = [lp for event in events for lp in (event.logprobs or [])]
    assert len(logprobs) == 4
    for entry in logprobs:
        assert len(entry.top) == 3
        assert entry.top[0].token_id == entry.token_id  # greedy picks the most likely
        assert entry.logprob <= 0.0


async def test_engine_preempts_instead_of_crashing_when_the_pool_runs_dry(smollm2):
    block_bytes = 16 * smollm2.config.kv_bytes_per_token(smollm2.cache_dtype.itemsize)
    engine = Engine(smollm2, EngineConfig(batch=4, kv_cache_bytes=12 * block_bytes))
    try:
        prompts = [smollm2.tokenizer.encode(p) for p in PROMPTS[:4]]
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        alone = [(await collect(engine, p, params))[0] for p in prompts]
        together = await asyncio.gather(*(collect(engine, p, params) for p in prompts))
        assert [tokens for tokens, _, _ in together] == alone
        engine.block_manager.check_invariants()
    finally:
        engine.close()


async def test_engine_keeps_decoding_running_streams_while_a_long_prompt_prefills(smollm2):
    engine = Engine(smollm2, EngineConfig(max_num_batched_tokens=32))
    try:
        params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        short = engine.submit(smollm2.tokenizer.encode("Count slowly:"), params)
        await anext(short)  # the short row is decoding
        long_prompt = smollm2.tokenizer.encode("The history of Rome. " * 80)
        long = engine.submit(long_prompt, SamplingParams(temperature=0, max_tokens=1))
        first_long = asyncio.ensure_future(anext(long))
        decoded_meanwhile = 0
        while not first_long.done():
            event = await anext(short)
            decoded_meanwhile += len(event.token_ids)
        # The prompt needs len/32 prefill steps; each of them also decoded the short row.
        assert decoded_meanwhile >= len(long_prompt) // 32 - 2
        short.cancel()
    finally:
        engine.close()


async def test_engine_hands_out_a_steps_token_before_the_next_steps_layers_run(
    smollm2, monkeypatch
):
    network = smollm2.network
    received = threading.Event()
    seen_in_time: list[bool] = []

    def gated_forward(batch, kv, before_layers):
        def layers_wait_for_the_last_token():
            before_layers()
            seen_in_time.append(received.wait(timeout=10))
            received.clear()

        decoding = batch.query_index.shape[1] == 1
        gate = layers_wait_for_the_last_token if decoding else before_layers
        return type(network).forward(network, batch, kv, gate)

    monkeypatch.setattr(network, "forward", gated_forward)
    engine = Engine(smollm2, EngineConfig(batch=2))
    try:
        prompt = smollm2.tokenizer.encode("Count slowly:")
        params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
        async for event in engine.submit(prompt, params):
            if event.token_ids:
                received.set()
    finally:
        engine.close()
    # Tokens 1-4 each reached the stream before the layers of the step after theirs ended.
    assert seen_in_time == [True] * 4


async def test_engine_hands_out_a_rows_first_token_before_the_next_step_starts(
    smollm2, monkeypatch
):
    network = smollm2.network
    received = threading.Event()
    seen_in_time: list[bool] = []

    def gated_forward(batch, kv, before_layers):
        if batch.query_index.shape[1] == 1 and not seen_in_time:  # the step after the prompt's
            seen_in_time.append(received.wait(timeout=10))  # before it hands anything out
        return type(network).forward(network, batch, kv, before_layers)

    monkeypatch.setattr(network, "forward", gated_forward)
    engine = Engine(smollm2, EngineConfig(batch=2))
    try:
        prompt = smollm2.tokenizer.encode("Count slowly:")
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        async for event in engine.submit(prompt, params):
            if event.token_ids:
                received.set()
    finally:
        engine.close()
    assert seen_in_time == [True]


def test_engine_default_pool_holds_one_full_context_and_an_explicit_budget_is_kept(smollm2):
    token_bytes = smollm2.config.kv_bytes_per_token(smollm2.cache_dtype.itemsize)
    block = EngineConfig().block_size
    default = EngineConfig(batch=8).num_blocks(smollm2, 8192)
    assert default * block >= 8192 + 1
    assert default * block * token_bytes <= 8 * (8192 + block) * token_bytes
    budget = 64 * block * token_bytes
    assert EngineConfig(kv_cache_bytes=budget).num_blocks(smollm2, 8192) == 64


@pytest.mark.parametrize("window", [None, 8])  # 8: Gemma 3's sliding mask too
def test_a_decode_steps_batch_is_the_one_the_general_path_builds(smollm2, window):
    engine = Engine(smollm2, EngineConfig(batch=4))
    engine.runner.sliding_window = window
    try:
        rows = []
        for seq_id, (prompt, generated) in enumerate([(5, 3), (17, 1), (40, 9)]):
            seq = Sequence.from_prompt(seq_id, list(range(1, prompt + 1)), SamplingParams())
            seq.token_ids.extend(range(100, 100 + generated))
            engine.block_manager.append_slots(seq, prompt + generated)
            rows.append(ScheduledRow(seq, prompt + generated - 1, 1, True))
        runner = engine.runner
        fast, general = runner._decode_batch(rows), runner._mixed_batch(rows)
        for name in ForwardBatch.__slots__:
            if name == "shared":  # what the layers will share: empty until they run
                continue
            a, b = getattr(fast, name), getattr(general, name)
            assert (a is None and b is None) or (
                isinstance(a, bool) and a == b or torch.equal(a, b)
            ), name
    finally:
        engine.close()


def test_building_an_engine_leaves_the_interpreters_switch_interval_alone(smollm2):
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    engine = Engine(smollm2, EngineConfig(batch=1, kv_cache_bytes=1 << 20))
    try:
        assert sys.getswitchinterval() == pytest.approx(0.005)
    finally:
        engine.close()
        sys.setswitchinterval(before)
