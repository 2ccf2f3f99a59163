"""Who must leave for a model to fit: a pure function of the budget and the residents' bytes.

The host owns the state; this module only decides. A decision is one of:

- it fits as things are (no victims);
- it fits once these idle models leave, least recently used first;
- wait, because only a busy model (leased, loading, draining, or inside its hold) could make room;
- load anyway after these victims: a model alone is always served, even one bigger than the budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Decision:
    fits: bool
    victims: tuple[str, ...] = ()
    wait: bool = False


def choose_victims(
    budget_bytes: int,
    used_bytes: int,
    need_bytes: int,
    candidates: Sequence[tuple[str, int]],
    *,
    others_busy: bool,
) -> Decision:
    """`candidates` are (id, bytes) of idle, unpinned residents, least recently used first."""
    if used_bytes + need_bytes <= budget_bytes:
        return Decision(fits=True)
    victims: list[str] = []
    freed = 0
    for model_id, num_bytes in candidates:
        victims.append(model_id)
        freed += num_bytes
        if used_bytes - freed + need_bytes <= budget_bytes:
            return Decision(fits=True, victims=tuple(victims))
    if others_busy:
        # Evicting the idle ones now would not be enough; wait for a busy one instead of
        # draining models that would then have to come back (thrashing).
        return Decision(fits=False, wait=True)
    return Decision(fits=False, victims=tuple(victims))


@dataclass(frozen=True, slots=True)
class Plan:
    """What loading a model would take now: `plan(id)` for operators and `/fit`-like views."""

    fits: bool
    required_bytes: int
    free_bytes: int
    evict: tuple[str, ...]
