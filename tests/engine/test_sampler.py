"""The batched sampler: what a request's knobs do to the tokens it gets back."""

from __future__ import annotations

import pytest
import torch

from modelhost.engine.sampling.sampler import RowSamplingState, sample
from modelhost.engine.sampling.sampling_params import SamplingParams

VOCAB = 1003  # deliberately not a multiple of a SIMD width


def _row(prompt_ids: list[int] | None = None, **knobs: object) -> RowSamplingState:
    return RowSamplingState.create(SamplingParams(**knobs), prompt_ids or [1, 2, 3])


def _random_logits(num_rows: int, seed: int, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn((num_rows, vocab), generator=torch.Generator().manual_seed(seed)) * 3


def _peaked_logits(num_rows: int) -> torch.Tensor:
    """Token 0 holds ~94% of the mass; tokens 1..9 share the rest (each ~e^-5 of token 0)."""
    logits = torch.full((num_rows, 10), 0.0)
    logits[:, 0] = 5.0
    return logits


def _tokens(logits: torch.Tensor, rows: list[RowSamplingState]) -> list[int]:
    return [t.token_id for t in sample(logits, rows)]


def test_sample_picks_argmax_when_temperature_is_zero() -> None:
    logits = _random_logits(4, seed=0)
    expected = logits.argmax(dim=-1).tolist()

    assert _tokens(logits, [_row(temperature=0.0) for _ in range(4)]) == expected


def test_sample_picks_argmax_for_greedy_rows_when_batched_with_sampled_rows() -> None:
    logits = _random_logits(4, seed=1)
    expected = logits.argmax(dim=-1).tolist()
    rows = [_row(temperature=0.0), _row(temperature=1.0, seed=3)] * 2

    tokens = _tokens(logits, rows)

    assert [tokens[0], tokens[2]] == [expected[0], expected[2]]


def test_sample_repeats_a_seeded_stream_when_batched_with_different_companions() -> None:
    knobs = dict(temperature=1.0, top_p=0.9, top_k=300, seed=1234)
    alone = _row(**knobs)
    batched = _row(**knobs)
    companions = [
        _row(temperature=0.0, logprobs=5),
        _row(temperature=0.7, top_k=600, seed=1),
        _row(temperature=1.3, min_p=0.05, repetition_penalty=1.3, seed=2),
        _row(temperature=0.9, top_p=0.5, presence_penalty=0.5, frequency_penalty=0.5),
    ]
    alone_tokens, batched_tokens = [], []
    for step in range(40):
        row_logits = _random_logits(1, seed=step)
        batch_logits = torch.cat((_random_logits(2, seed=1000 + step), row_logits))
        batch_logits = torch.cat((batch_logits, _random_logits(2, seed=2000 + step)))

        alone_tokens += _tokens(row_logits.clone(), [alone])
        batched_tokens.append(_tokens(batch_logits, companions[:2] + [batched] + companions[2:])[2])
        for state, token in ((alone, alone_tokens[-1]), (batched, batched_tokens[-1])):
            state.output_ids.append(token)

    assert batched_tokens == alone_tokens


def test_sample_gives_different_streams_when_seeds_differ() -> None:
    rows = [_row(temperature=1.0, seed=seed) for seed in (1, 2)]
    streams: list[list[int]] = [[], []]
    for step in range(20):
        logits = _random_logits(1, seed=step).repeat(2, 1)
        for stream, token in zip(streams, _tokens(logits, rows), strict=True):
            stream.append(token)

    assert streams[0] != streams[1]


def test_sample_matches_greedy_when_top_k_is_one() -> None:
    logits = _random_logits(16, seed=2)
    expected = logits.argmax(dim=-1).tolist()
    rows = [_row(temperature=1.5, top_k=1, seed=seed) for seed in range(16)]

    assert _tokens(logits, rows) == expected


def test_sample_never_leaves_the_top_k_when_top_k_is_set() -> None:
    logits = _random_logits(64, seed=3)
    allowed = logits.topk(3, dim=-1).indices.tolist()
    rows = [_row(temperature=2.0, top_k=3, seed=seed) for seed in range(64)]

    tokens = _tokens(logits, rows)

    assert all(token in allowed[i] for i, token in enumerate(tokens))


def test_sample_returns_the_biased_token_when_logit_bias_is_large() -> None:
    logits = _random_logits(8, seed=4)
    rows = [_row(temperature=1.0, logit_bias={17: 100.0}, seed=seed) for seed in range(8)]

    assert _tokens(logits, rows) == [17] * 8


def test_sample_never_returns_a_token_when_logit_bias_bans_it() -> None:
    logits = _peaked_logits(1)
    row = _row(temperature=0.0, logit_bias={0: -100.0})

    assert _tokens(logits, [row]) != [0]


def test_sample_avoids_a_repeated_token_when_repetition_penalty_is_set() -> None:
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 3.0, 2.0]])
    row = _row(prompt_ids=[5], temperature=0.0, repetition_penalty=2.0)

    assert _tokens(logits, [row]) == [6]


def test_sample_avoids_a_repeated_token_when_its_logit_is_negative() -> None:
    logits = torch.tensor([[-9.0, -9.0, -9.0, -9.0, -9.0, -1.0, -1.5]])
    row = _row(prompt_ids=[1], temperature=0.0, repetition_penalty=2.0)
    row.output_ids.append(5)

    assert _tokens(logits, [row]) == [6]


def test_sample_penalises_each_occurrence_when_frequency_penalty_is_set() -> None:
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 3.0, 2.0]]).repeat(2, 1)
    once = _row(temperature=0.0, frequency_penalty=0.6)
    twice = _row(temperature=0.0, frequency_penalty=0.6)
    once.output_ids += [5]
    twice.output_ids += [5, 5]

    assert _tokens(logits, [once, twice]) == [5, 6]


def test_sample_penalises_a_token_once_when_presence_penalty_is_set() -> None:
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 3.0, 2.0]])
    row = _row(temperature=0.0, presence_penalty=0.6)
    row.output_ids += [5, 5, 5]

    assert _tokens(logits, [row]) == [5]


def test_sample_ignores_prompt_tokens_when_presence_penalty_is_set() -> None:
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 3.0, 2.0]])
    row = _row(prompt_ids=[5, 5, 5], temperature=0.0, presence_penalty=5.0, frequency_penalty=5.0)

    assert _tokens(logits, [row]) == [5]


def test_sample_draws_low_probability_tokens_when_no_filter_is_set() -> None:
    rows = [_row(temperature=1.0, seed=seed) for seed in range(200)]

    assert set(_tokens(_peaked_logits(200), rows)) != {0}


@pytest.mark.parametrize("temperature", [0.5, 1.0, 5.0])
def test_sample_draws_from_the_softmax_of_the_logits_over_the_temperature(
    temperature: float,
) -> None:
    draws = 2000
    rows = [_row(temperature=temperature, seed=seed) for seed in range(draws)]
    expected = torch.softmax(_peaked_logits(1)[0] / temperature, dim=-1)[0].item()

    share = _tokens(_peaked_logits(draws), rows).count(0) / draws

    assert share == pytest.approx(expected, abs=0.03)


def test_sample_drops_tokens_below_min_p_when_min_p_is_set() -> None:
    rows = [_row(temperature=1.0, min_p=0.1, seed=seed) for seed in range(200)]

    assert set(_tokens(_peaked_logits(200), rows)) == {0}


def test_sample_keeps_only_the_nucleus_when_top_p_is_set() -> None:
    rows = [_row(temperature=1.0, top_p=0.9, seed=seed) for seed in range(200)]

    assert set(_tokens(_peaked_logits(200), rows)) == {0}


def test_sample_keeps_the_whole_nucleus_when_it_spans_thousands_of_tokens() -> None:
    vocab = 6000
    logits = (-torch.arange(vocab, dtype=torch.float32) * 2e-4).repeat(300, 1)
    cumulative = torch.softmax(logits[0], dim=-1).cumsum(dim=-1)
    nucleus_size = int((cumulative < 0.9).sum()) + 1
    rows = [_row(temperature=1.0, top_p=0.9, seed=seed) for seed in range(300)]

    tokens = _tokens(logits, rows)

    assert max(tokens) < nucleus_size
    assert max(tokens) >= 4096  # the near-uniform nucleus is sampled across its whole width


def test_sample_reports_raw_model_logprobs_when_logprobs_are_requested() -> None:
    logits = _random_logits(2, seed=5)
    expected = torch.log_softmax(logits, dim=-1)
    rows = [_row(temperature=0.0, logprobs=3, logit_bias={42: 50.0, 7: 50.0}) for _ in range(2)]

    results = sample(logits.clone(), rows)

    for i, result in enumerate(results):
        top = expected[i].topk(3)
        assert result.logprob is not None
        assert abs(result.logprob - expected[i, result.token_id].item()) < 1e-5
        assert result.top_ids == top.indices.tolist()
        assert result.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-5)


def test_sample_reports_only_the_chosen_logprob_when_logprobs_is_zero() -> None:
    logits = _random_logits(1, seed=6)
    expected = torch.log_softmax(logits, dim=-1)

    (result,) = sample(logits.clone(), [_row(temperature=0.0, logprobs=0)])

    assert result.logprob is not None
    assert abs(result.logprob - expected[0, result.token_id].item()) < 1e-5
    assert (result.top_ids, result.top_logprobs) == ([], [])


def test_sample_reports_no_logprobs_when_logprobs_are_off() -> None:
    (result,) = sample(_random_logits(1, seed=7), [_row(temperature=1.0, seed=1)])

    assert (result.logprob, result.top_ids, result.top_logprobs) == (None, [], [])


def test_sample_returns_nothing_when_there_are_no_rows() -> None:
    assert sample(torch.empty((0, VOCAB)), []) == []
