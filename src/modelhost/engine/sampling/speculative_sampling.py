"""Speculative sampling: keep a draft model's sampled guess, or replace it, so that the token
that comes out is distributed as the target model's own.

A draft model proposes token x drawn from its distribution q; the target's distribution at the
same position is p. Accepting x with probability min(1, p(x) / q(x)), and otherwise drawing from
the residual max(0, p - q) renormalised, yields a token distributed exactly as p (Leviathan et
al. 2023, Chen et al. 2023): P(y) = q(y) min(1, p(y)/q(y)) + (1 - sum_z min(p(z), q(z)))
residual(y) = min(p(y), q(y)) + max(0, p(y) - q(y)) = p(y). The acceptance rate is
sum_z min(p(z), q(z)), one minus the total-variation distance between the two.

Both draws take one float64 uniform from the row's own generator, as the plain sampler's
inverse-CDF draw does (engine/sampling/sampler.py).
"""

from __future__ import annotations

import torch


def draw_from(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from `probs` (a 1-D distribution, any non-negative mass) by inverting its CDF
    at one uniform of `generator`."""
    uniform = torch.rand((), dtype=torch.float64, generator=generator).item()
    cdf = probs.double().cumsum(0)
    total = cdf[-1]
    target = min(uniform * float(total), torch.nextafter(total, total.new_zeros(())).item())
    token = int(torch.searchsorted(cdf, torch.tensor([target], dtype=cdf.dtype), right=True))
    return min(token, probs.shape[0] - 1)


def accept_or_resample(
    p: torch.Tensor, q: torch.Tensor, guess: int, generator: torch.Generator | None
) -> tuple[int, bool]:
    """The token emitted at a position where the draft guessed `guess` drawn from `q`, the
    target's distribution being `p` (both 1-D over the same vocabulary, each summing to one):
    (guess, True) when it is kept, else (a draw from the residual, False)."""
    uniform = torch.rand((), dtype=torch.float64, generator=generator).item()
    p_guess, q_guess = float(p[guess]), float(q[guess])
    if q_guess > 0.0 and uniform * q_guess < p_guess:
        return guess, True
    residual = (p.double() - q.double()).clamp_(min=0.0)
    if float(residual.sum()) <= 0.0:  # p == q up to rounding: a rejection cannot happen in
        residual = p.double()  # exact arithmetic; p is what the residual would be then
    return draw_from(residual, generator), False
