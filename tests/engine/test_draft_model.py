"""Draft-model speculation: a small model with the target's tokenizer guesses ahead, and the
answers are the target's own (token for token at temperature 0 and with a seed)."""

from __future__ import annotations

import asyncio

import pytest
from tiny_gguf import write_gguf_from_hf
from tiny_models import make_tiny_checkpoint

from modelhost.engine.draft_model import DraftMismatch
from modelhost.engine.engine import Engine, EngineConfig
from modelhost.engine.events import EngineEvent
from modelhost.engine.sampling.sampling_params import SamplingParams
from modelhost.models.loaded import LoadedModel
from modelhost.models.loading.loader import load_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def tiny(tmp_path_factory, donor: LoadedModel, name: str, **shape) -> LoadedModel:
    directory = tmp_path_factory.mktemp(name)
    make_tiny_checkpoint(directory, "llama", donor, initializer_range=0.3, **shape)
    path = write_gguf_from_hf(directory, directory.parent / f"{name}.gguf")
    model = load_model(str(path), quantize="auto")
    model.id = name
    return model


@pytest.fixture(scope="module")
def target(tmp_path_factory, smollm2) -> LoadedModel:
    return tiny(tmp_path_factory, smollm2, "tiny-target")


@pytest.fixture(scope="module")
def twin(tmp_path_factory, smollm2) -> LoadedModel:
    """The target's weights loaded again: a draft whose guesses mostly land."""
    return tiny(tmp_path_factory, smollm2, "tiny-twin")


@pytest.fixture(scope="module")
def tinier(tmp_path_factory, smollm2) -> LoadedModel:
    """One layer and half the width: a draft whose guesses mostly miss."""
    return tiny(
        tmp_path_factory, smollm2, "tinier", num_hidden_layers=1, hidden_size=32,
        intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip


def tokens_of(events: list[EngineEvent]) -> list[int]:
    return [token for event in events for token in event.token_ids]


async def events_of(engine: Engine, prompt: list[int], params: SamplingParams):
    return [event async for event in engine.submit(prompt, params)]


def run(model, jobs, *, speculate="none", draft=None, **config):
    """Each job's events (submitted together), the engine's stats and its draft's used blocks."""

    async def go():
        engine = Engine(model, EngineConfig(speculate=speculate, **config), draft=draft)
        try:
            results = await asyncio.gather(*(events_of(engine, p, params) for p, params in jobs))
            engine.block_manager.check_invariants()
            draft_used = None
            if engine.draft is not None:
                engine.draft.block_manager.check_invariants()
                draft_used = engine.draft.block_manager.num_used_blocks
            return results, engine.stats(), draft_used
        finally:
            engine.close()

    return asyncio.run(go())


def prompts(model: LoadedModel) -> list[list[int]]:
    encode = model.tokenizer.encode
    return [encode("Once upon a time there was"), encode("The rain in Spain stays mainly in")]


@pytest.mark.parametrize("draft_name", ["twin", "tinier"])
def test_greedy_answers_are_the_same_with_a_draft_model_alone_and_batched(
    request, target, draft_name
):
    draft = request.getfixturevalue(draft_name)
    first, second = prompts(target)
    for jobs in ([(first, GREEDY)], [(first, GREEDY), (second, GREEDY)]):
        plain, _, _ = run(target, jobs, block_size=4)
        guessed, stats, draft_used = run(target, jobs, speculate="draft", draft=draft, block_size=4)
        assert [tokens_of(e) for e in guessed] == [tokens_of(e) for e in plain]
        assert stats.spec_draft_model == draft_name.replace("twin", "tiny-twin")
        assert stats.spec_model_draft_tokens > 0
        assert stats.spec_draft_forwards > 0
        assert draft_used == 0  # every row's draft KV went back to the pool
        assert stats.kv_blocks_used == 0


def test_a_draft_with_the_targets_weights_has_most_guesses_kept(target, twin):
    (events,), stats, _ = run(target, [(prompts(target)[0], GREEDY)], speculate="draft", draft=twin)
    assert stats.spec_model_accepted_tokens > stats.spec_model_draft_tokens / 2
    usage = events[-1].usage
    assert usage.draft_tokens == stats.spec_draft_tokens
    assert usage.accepted_draft_tokens == stats.spec_accepted_tokens
    assert stats.steps < usage.completion_tokens  # fewer target forwards than tokens


def test_seeded_samples_are_the_same_with_a_draft_model(target, tinier):
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=40, ignore_eos=True)
    jobs = [(p, params) for p in prompts(target)]
    plain, _, _ = run(target, jobs)
    guessed, stats, _ = run(target, jobs, speculate="draft", draft=tinier)
    assert [tokens_of(e) for e in guessed] == [tokens_of(e) for e in plain]
    assert stats.spec_model_draft_tokens > 0


def test_unseeded_samples_with_a_draft_model_use_speculative_sampling(target, twin):
    params = SamplingParams(temperature=0.8, max_tokens=40, ignore_eos=True, logprobs=2)
    jobs = [(p, params) for p in prompts(target)]
    results, stats, draft_used = run(target, jobs, speculate="draft", draft=twin)
    for events in results:
        assert len(tokens_of(events)) == 40
        assert len([lp for e in events for lp in e.logprobs or []]) == 40
    # The twin's q is the target's p: speculative sampling keeps nearly every drawn guess.
    assert stats.spec_model_accepted_tokens > stats.spec_model_draft_tokens * 0.8
    assert draft_used == 0


def test_auto_with_a_draft_model_gives_the_answer_of_no_guessing(target, twin):
    jobs = [(p, GREEDY) for p in prompts(target)]
    plain, _, _ = run(target, jobs)
    guessed, stats, draft_used = run(target, jobs, speculate="auto", draft=twin)
    assert [tokens_of(e) for e in guessed] == [tokens_of(e) for e in plain]
    assert stats.speculate == "auto"
    assert draft_used == 0


def test_a_draft_model_with_another_tokenizer_is_refused(smollm2, gemma3):
    with pytest.raises(DraftMismatch, match="tokenizers differ"):
        Engine(smollm2, EngineConfig(speculate="draft"), draft=gemma3)


def test_a_cancelled_row_frees_its_draft_blocks(target, twin):
    async def go():
        engine = Engine(target, EngineConfig(speculate="draft"), draft=twin)
        try:
            params = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)
            stream = engine.submit(prompts(target)[0], params)
            received = 0
            async for event in stream:
                received += len(event.token_ids)
                if received >= 20:
                    break
            stream.cancel()
            for _ in range(500):
                if engine.stats().active_rows == 0:
                    break
                await asyncio.sleep(0.01)
            assert engine.draft is not None
            return engine.stats(), engine.draft.block_manager.num_used_blocks
        finally:
            engine.close()

    stats, draft_used = asyncio.run(go())
    assert stats.active_rows == 0
    assert draft_used == 0
