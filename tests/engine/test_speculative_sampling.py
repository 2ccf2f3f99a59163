"""Speculative sampling's accept/reject routine: whatever the draft's distribution, the tokens
it lets through are distributed as the target's."""

from __future__ import annotations

import pytest
import torch

from modelhost.engine.sampling.speculative_sampling import accept_or_resample, draw_from

DRAWS = 20_000


def frequencies(p: torch.Tensor, q: torch.Tensor, seed: int) -> tuple[torch.Tensor, float]:
    """Empirical frequencies of the emitted token over DRAWS guesses drawn from q, and the
    share of guesses kept."""
    generator = torch.Generator().manual_seed(seed)
    counts = torch.zeros(p.shape[0])
    kept = 0
    for _ in range(DRAWS):
        guess = draw_from(q, generator)
        token, accepted = accept_or_resample(p, q, guess, generator)
        counts[token] += 1
        kept += accepted
    return counts / DRAWS, kept / DRAWS


def chi_square(observed: torch.Tensor, expected: torch.Tensor) -> float:
    keep = expected > 0
    return float(DRAWS * ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())


P = torch.tensor([0.05, 0.4, 0.0, 0.25, 0.3])


@pytest.mark.parametrize(
    "q",
    [
        torch.tensor([0.3, 0.1, 0.3, 0.2, 0.1]),  # mass where p has none, and too little at 1
        torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2]),
        torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0]),  # a point mass: kept with probability p(3)
        P.clone(),  # the target itself: always kept
    ],
)
def test_emitted_tokens_follow_the_targets_distribution_whatever_the_draft(q):
    observed, kept = frequencies(P, q, seed=1234)
    assert observed[2] == 0  # a token the target rules out never comes out
    # Chi-square with 3 degrees of freedom (4 possible tokens): 16.3 is the 0.1% tail.
    assert chi_square(observed, P) < 16.3
    # The share kept is the overlap of the two distributions, one minus their distance.
    assert kept == pytest.approx(float(torch.minimum(P, q).sum()), abs=0.015)


def test_the_same_seed_gives_the_same_tokens():
    q = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2])

    def tokens(seed: int) -> list[tuple[int, bool]]:
        generator = torch.Generator().manual_seed(seed)
        return [accept_or_resample(P, q, guess, generator) for guess in (0, 1, 2, 3, 4) * 20]

    assert tokens(9) == tokens(9)
    assert tokens(9) != tokens(10)
