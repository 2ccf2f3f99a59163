"""What speculation weighs guesses against: a step size's cost is the least of its recent
times, steady while the machine is busy, and a size judged on a busy stretch is tried again."""

from __future__ import annotations

from modelhost.engine.step_costs import STALE_STEPS, StepCosts


def test_a_step_size_costs_the_least_of_its_recent_times():
    costs = StepCosts()
    for seconds in (0.085, 0.010, 0.040):  # a neighbour's burst before and after
        costs.record(1, seconds)
    assert costs.seconds(1) == 0.010


def test_a_size_not_seen_costs_the_dearest_size_seen_below_it():
    costs = StepCosts()
    costs.record(1, 0.010)
    costs.record(3, 0.014)
    assert costs.seconds(5) == 0.014
    assert costs.seconds(2) == 0.010
    assert StepCosts().seconds(4, unseen=1.0) == 1.0


def test_a_size_judged_on_a_busy_stretch_is_tried_again_once_its_times_are_stale():
    costs = StepCosts()
    costs.record(1, 0.010)
    costs.record(5, 0.500)  # one verification step while the machine was busy
    assert costs.seconds(5) == 0.500
    for _ in range(STALE_STEPS):
        costs.record(1, 0.010)
    assert costs.known(5) is None
    assert costs.seconds(5) == 0.010  # optimistic again: worth a try
