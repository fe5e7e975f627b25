"""An upload budget's arithmetic (averaging/budget.py): the round factor a peer asks for, from what its rounds cost."""
from __future__ import annotations

import pytest

from averaging.budget import (
    BYTES_PER_MBIT,
    CostEstimate,
    RoundCost,
    UploadMeter,
    choose_factor,
    smallest_factor,
)

MB = 1e6
# 25 MB a round, 10 s of training per target batch, 2 s in the round: 200 Mbit / 12 s, about 17 Mbit/s at factor 1
COST = RoundCost(bytes_per_round=25 * MB, train_seconds=10.0, round_seconds=2.0)


def test_the_rate_falls_as_the_round_grows():
    assert COST.mbit(1) == pytest.approx(25 * MB / BYTES_PER_MBIT / 12.0)
    assert COST.mbit(1) > COST.mbit(2) > COST.mbit(8)


def test_a_lower_budget_gives_a_longer_round_and_a_higher_one_a_shorter_one_never_below_1():
    factors = [choose_factor(COST, budget, current=1, max_factor=64).factor for budget in (20.0, 5.0, 2.0, 1.0)]
    assert factors == sorted(factors) and factors[0] < factors[-1]
    for budget in (5.0, 2.0, 1.0):
        choice = choose_factor(COST, budget, current=1, max_factor=64)
        assert choice.meets and COST.mbit(choice.factor) <= budget
        assert choice.factor == 1 or COST.mbit(choice.factor - 1) > budget  # the smallest that meets it
    # a generous budget: rounds keep the target batch; from a long round, it comes back down to 1
    assert choose_factor(COST, 1000.0, current=1, max_factor=64).factor == 1
    assert choose_factor(COST, 1000.0, current=16, max_factor=64).factor == 1


def test_more_bytes_per_round_give_a_longer_round():
    heavier = RoundCost(bytes_per_round=4 * COST.bytes_per_round, train_seconds=10.0, round_seconds=2.0)
    assert choose_factor(heavier, 2.0, 1, 64).factor > choose_factor(COST, 2.0, 1, 64).factor


def test_the_factor_is_clamped_at_the_longest_round_and_says_when_even_that_is_over_budget():
    needs = smallest_factor(COST, 1.0, max_factor=64)
    assert needs is not None and needs > 4
    choice = choose_factor(COST, 1.0, current=1, max_factor=4)
    assert (choice.factor, choice.meets) == (4, False)
    assert choice.mbit == pytest.approx(COST.mbit(4)) and choice.mbit > 1.0
    assert smallest_factor(COST, 1.0, max_factor=4) is None
    # with --max-round-factor 1 the budget cannot move anything: it is met or it is not
    assert choose_factor(COST, 100.0, 1, 1).factor == 1 and not choose_factor(COST, 1.0, 1, 1).meets


def test_decreases_wait_for_headroom_so_that_the_factor_does_not_flap():
    up = choose_factor(COST, 2.0, current=1, max_factor=64).factor
    # a budget just above what a factor one lower would need: the lower factor would fit, but not with 20% to spare
    lower = up - 1
    budget = COST.mbit(lower) * 1.05
    assert choose_factor(COST, budget, current=up, max_factor=64).factor == up
    # with plenty of headroom it comes down, to the smallest factor that leaves it
    roomy = COST.mbit(lower) / 0.7
    come_down = choose_factor(COST, roomy, current=up, max_factor=64)
    assert come_down.factor < up and COST.mbit(come_down.factor) <= 0.8 * roomy
    # and an increase is never delayed
    assert choose_factor(COST, COST.mbit(up) * 0.99, current=up, max_factor=64).factor == up + 1


def test_a_cost_is_known_once_a_round_with_others_and_an_epoch_were_measured():
    estimate = CostEstimate(epochs=3)
    assert estimate.cost() is None
    estimate.observe_epoch(train_seconds=20.0, round_seconds=1.0, factor=2)
    assert estimate.cost() is None  # no round with others yet: nothing says what a round sends
    estimate.observe_round(1000)
    assert estimate.cost() == RoundCost(1000.0, 10.0, 1.0)  # training per target batch
    for train in (30.0, 12.0, 14.0):
        estimate.observe_epoch(train_seconds=train, round_seconds=3.0, factor=1)
    assert estimate.cost() == RoundCost(1000.0, 14.0, 3.0)  # the median of the last three


def test_the_meter_averages_over_a_minute_or_over_the_round_interval_when_rounds_are_further_apart():
    meter = UploadMeter(started=0.0)
    mbit = 60 * BYTES_PER_MBIT  # bytes that make 1 Mbit/s over a minute
    for when in (60.0, 90.0, 120.0):
        meter.record(when, int(mbit / 2))
    assert meter.mbit(120.0) == pytest.approx(1.0)  # the rounds at 90 and 120 (60 fell out of the minute)
    sparse = UploadMeter(started=0.0)
    sparse.record(100.0, int(mbit))
    sparse.record(400.0, int(mbit))  # five minutes apart: averaged over the interval, not a spike of a minute
    assert sparse.mbit(400.0) == pytest.approx(60 / 300)
    assert sparse.mbit(800.0) == 0.0  # nothing sent for longer than an interval
