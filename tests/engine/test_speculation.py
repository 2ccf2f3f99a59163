"""Speculation on the real SmolLM2 and on every family's tiny checkpoint: the tokens, logprobs,
stops and limits a row gets are the ones it gets without guessing, and the guesses are counted."""

from __future__ import annotations

import asyncio

import pytest
from tiny_gguf import write_gguf_from_hf
from tiny_models import ARCHITECTURES, make_tiny_checkpoint

from modelhost.engine.engine import Engine, EngineConfig
from modelhost.engine.events import EngineEvent
from modelhost.engine.sampling.sampling_params import SamplingParams
from modelhost.models.loaded import LoadedModel
from modelhost.models.loading.loader import load_model

CODE = """def load_users(path):
    users = []
    with open(path) as handle:
        for line in handle:
            name, age = line.strip().split(",")
            users.append({"name": name, "age": int(age)})
    return users


def oldest_user(users):
    best = None
    for user in users:
        if best is None or user["age"] > best["age"]:
            best = user
    return best
"""
COPY = CODE + "\nRename load_users to read_users in the code above and print the full code."
STORY = "Write a short story about a lighthouse keeper."
GREEDY = SamplingParams(temperature=0.0, max_tokens=120)


def chat(model: LoadedModel, text: str) -> list[int]:
    return model.tokenizer.encode_chat([{"role": "user", "content": text}])


async def events_of(engine: Engine, prompt: list[int], params: SamplingParams):
    return [event async for event in engine.submit(prompt, params)]


def tokens_of(events: list[EngineEvent]) -> list[int]:
    return [token for event in events for token in event.token_ids]


def text_of(events: list[EngineEvent]) -> str:
    return "".join(event.text for event in events)


def run(model: LoadedModel, speculate: str, jobs, **config):
    """Each (prompt, params) job's events, the jobs submitted together, and the engine's stats."""

    async def go():
        engine = Engine(model, EngineConfig(speculate=speculate, **config))
        try:
            results = await asyncio.gather(*(events_of(engine, p, params) for p, params in jobs))
            engine.block_manager.check_invariants()
            return results, engine.stats()
        finally:
            engine.close()

    return asyncio.run(go())


def test_a_copying_answer_is_the_same_with_guesses_and_most_guesses_land(smollm2):
    jobs = [(chat(smollm2, COPY), GREEDY)]
    (plain,), _ = run(smollm2, "none", jobs)
    (guessed,), stats = run(smollm2, "ngram", jobs)
    assert tokens_of(guessed) == tokens_of(plain)
    assert text_of(guessed) == text_of(plain)
    assert stats.speculate == "ngram"
    assert stats.spec_accepted_tokens > stats.spec_draft_tokens / 2 > 0
    assert stats.steps < len(tokens_of(plain))  # fewer forwards than tokens


def test_the_default_auto_mode_gives_the_answer_of_no_guessing(smollm2):
    jobs = [(chat(smollm2, COPY), GREEDY), (chat(smollm2, STORY), GREEDY)]
    plain, _ = run(smollm2, "none", jobs)
    guessed, stats = run(smollm2, "auto", jobs)
    assert [tokens_of(e) for e in guessed] == [tokens_of(e) for e in plain]
    assert stats.speculate == "auto"


def test_greedy_rows_batched_together_answer_as_they_do_without_guesses(smollm2):
    jobs = [
        (chat(smollm2, COPY), GREEDY),
        (chat(smollm2, STORY), GREEDY),
        (smollm2.tokenizer.encode("one two three one two three one two"), GREEDY),
    ]
    plain, _ = run(smollm2, "none", jobs)
    guessed, stats = run(smollm2, "ngram", jobs)
    assert [tokens_of(e) for e in guessed] == [tokens_of(e) for e in plain]
    assert stats.spec_draft_tokens > 0


def test_seeded_samples_penalties_and_logprobs_are_the_same_with_guesses(smollm2):
    sampled = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=80)
    penalised = SamplingParams(
        temperature=0.0, max_tokens=80, frequency_penalty=0.3, repetition_penalty=1.1
    )
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=80, logprobs=3)
    prompt = chat(smollm2, COPY)
    jobs = [(prompt, sampled), (prompt, penalised), (prompt, with_logprobs)]
    plain, _ = run(smollm2, "none", jobs)
    guessed, stats = run(smollm2, "ngram", jobs)
    assert [tokens_of(e) for e in guessed] == [tokens_of(e) for e in plain]
    logprobs = [
        [lp for e in events for lp in e.logprobs or []] for events in (plain[2], guessed[2])
    ]
    assert logprobs[1] == logprobs[0]
    assert len(logprobs[1]) == 80
    assert stats.spec_accepted_tokens > 0


def test_a_stop_string_ends_the_answer_where_it_does_without_guesses(smollm2):
    params = SamplingParams(temperature=0.0, max_tokens=120, stop=("oldest",))
    jobs = [(chat(smollm2, COPY), params)]
    (plain,), _ = run(smollm2, "none", jobs)
    (guessed,), _ = run(smollm2, "ngram", jobs)
    assert text_of(guessed) == text_of(plain)
    assert guessed[-1].finish_reason == plain[-1].finish_reason == "stop"
    guessed_usage, plain_usage = guessed[-1].usage, plain[-1].usage
    assert guessed_usage is not None and plain_usage is not None
    assert guessed_usage.completion_tokens == plain_usage.completion_tokens
    assert guessed_usage.prompt_tokens == plain_usage.prompt_tokens
    assert guessed_usage.draft_tokens > 0 == plain_usage.draft_tokens  # and usage counts them


@pytest.mark.parametrize("max_tokens", [1, 2, 37])
def test_guesses_never_take_an_answer_past_max_tokens(smollm2, max_tokens):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    (events,), _ = run(smollm2, "ngram", [(chat(smollm2, COPY), params)])
    assert len(tokens_of(events)) == max_tokens
    assert events[-1].finish_reason == "length"
    assert events[-1].usage.completion_tokens == max_tokens


def test_a_row_that_opts_out_never_guesses(smollm2):
    params = SamplingParams(temperature=0.0, max_tokens=60, speculate=False)
    (events,), stats = run(smollm2, "ngram", [(chat(smollm2, COPY), params)])
    assert len(tokens_of(events)) == 60
    assert stats.spec_draft_tokens == 0


def test_rejected_guesses_leave_no_blocks_behind(smollm2):
    jobs = [(chat(smollm2, STORY), GREEDY), (chat(smollm2, COPY), GREEDY)]

    async def go():
        engine = Engine(smollm2, EngineConfig(speculate="ngram", block_size=4))
        try:
            await asyncio.gather(*(events_of(engine, p, params) for p, params in jobs))
            engine.block_manager.check_invariants()
            return engine.stats()
        finally:
            engine.close()

    stats = asyncio.run(go())
    assert stats.kv_blocks_used == 0
    assert stats.spec_draft_tokens > stats.spec_accepted_tokens  # some guesses were rejected


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def tiny_native(request, tmp_path_factory, smollm2):
    """Each family's tiny checkpoint as llama.cpp writes it, on the native kernels."""
    directory = tmp_path_factory.mktemp(request.param)
    make_tiny_checkpoint(
        directory, request.param, smollm2, max_position_embeddings=1024, initializer_range=0.3
    )
    path = write_gguf_from_hf(directory, directory.parent / f"{request.param}.gguf")
    return request.param, load_model(str(path), quantize="auto")


def test_every_familys_greedy_answers_are_the_same_with_guesses_alone_and_batched(
    tiny_native, smollm2
):
    family, model = tiny_native
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    copying = smollm2.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 6)
    free = smollm2.tokenizer.encode("Once upon a time there was")
    for jobs in ([(copying, params)], [(free, params)], [(copying, params), (free, params)]):
        plain, _ = run(model, "none", jobs, block_size=4)
        guessed, stats = run(model, "ngram", jobs, block_size=4)
        assert [tokens_of(e) for e in guessed] == [tokens_of(e) for e in plain], family
    # Longrope switches its tables on a row's length within a step: that family never guesses.
    assert stats.speculate == ("none" if family == "phi3" else "ngram")
    assert (stats.spec_draft_tokens > 0) == (family != "phi3")  # the copying prompt guesses


def test_a_stream_cancelled_while_guessing_frees_its_row_and_blocks(smollm2):
    async def go():
        engine = Engine(smollm2, EngineConfig(speculate="ngram"))
        try:
            stream = engine.submit(
                chat(smollm2, COPY), SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)
            )
            received = 0
            async for event in stream:
                received += len(event.token_ids)
                if received >= 40:
                    break
            stream.cancel()
            for _ in range(500):
                if engine.stats().active_rows == 0:
                    break
                await asyncio.sleep(0.01)
            engine.block_manager.check_invariants()
            return engine.stats()
        finally:
            engine.close()

    stats = asyncio.run(go())
    assert stats.active_rows == 0
    assert stats.kv_blocks_used == 0
    assert stats.spec_draft_tokens > 0


def test_rows_preempted_when_the_pool_runs_dry_answer_as_they_do_without_guesses(smollm2):
    block_bytes = 16 * smollm2.config.kv_bytes_per_token(smollm2.cache_dtype.itemsize)
    repeating = smollm2.tokenizer.encode("one two three four one two three four one two")
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    jobs = [(repeating, params)] * 2 + [(smollm2.tokenizer.encode("My favourite book is"), params)]
    config = {"batch": 4, "kv_cache_bytes": 10 * block_bytes}
    plain, _ = run(smollm2, "none", jobs, **config)
    guessed, stats = run(smollm2, "ngram", jobs, **config)
    assert [tokens_of(e) for e in guessed] == [tokens_of(e) for e in plain]
    assert stats.spec_draft_tokens > 0
