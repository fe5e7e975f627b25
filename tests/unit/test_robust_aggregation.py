"""Robust aggregation (what a reducer keeps and how it combines it) and the exclusion book."""
from __future__ import annotations

import pytest
import torch

from averaging.pipeline.defence import Verdict
from averaging.pipeline.exclusion import ExclusionBook, ExclusionRule
from averaging.pipeline.robust import Contribution, NothingToAggregate, RobustPolicy, aggregate

POLICY = RobustPolicy(rule="mean")  # the checks: a plain mean of what is left shows what was kept


def honest_parts(count: int, size: int = 1000, seed: int = 0):
    """Gradients of one signal plus per-peer noise: pairwise cosine about 0.5, like bytelm-tiny's mid-run."""
    generator = torch.Generator().manual_seed(seed)
    signal = torch.randn(size, generator=generator)
    return [signal + torch.randn(size, generator=generator) for _ in range(count)]


def contributions(parts, weights=None):
    weights = weights or [1.0] * len(parts)
    return [Contribution(index, part, weight) for index, (part, weight) in enumerate(zip(parts, weights))]


def weighted_mean(parts, weights):
    return sum(part * weight for part, weight in zip(parts, weights)) / sum(weights)


def test_honest_contributions_give_exactly_the_weighted_mean_and_nothing_is_dropped():
    parts, weights = honest_parts(4), [1.0, 2.0, 3.0, 4.0]
    result, drops, _, _, _ = aggregate(contributions(parts, weights), POLICY)
    assert drops == []
    assert torch.allclose(result, weighted_mean(parts, weights), atol=1e-6)


@pytest.mark.parametrize("attack, reason", [
    (lambda part: part * float("nan"), "non-finite"),
    (lambda part: part * float("inf"), "non-finite"),
    (lambda part: part * 1e4, "norm"),
    (lambda part: part * -1, "direction"),
])
def test_a_malicious_contribution_is_dropped_and_the_others_are_averaged_without_it(attack, reason):
    parts = honest_parts(4)
    parts[2] = attack(parts[2])
    result, drops, _, _, _ = aggregate(contributions(parts), POLICY)
    assert [(drop.sender, drop.reason) for drop in drops] == [(2, reason)]
    assert torch.allclose(result, weighted_mean([parts[0], parts[1], parts[3]], [1, 1, 1]), atol=1e-6)


def test_a_bad_weight_is_dropped():
    parts = honest_parts(3)
    result, drops, _, fully_judged, _ = aggregate(contributions(parts, [1.0, float("inf"), 1.0]), POLICY)
    assert [(drop.sender, drop.reason) for drop in drops] == [(1, "weight")]
    assert not fully_judged  # two left: a sign flip among them could not have been told
    assert torch.allclose(result, (parts[0] + parts[2]) / 2, atol=1e-6)


def test_two_senders_cannot_outvote_each_other_so_only_non_finite_values_are_dropped():
    honest, scaled = honest_parts(2)
    result, drops, _, _, _ = aggregate(contributions([honest, scaled * 1e4]), POLICY)
    assert drops == []  # who of two is the liar cannot be told from their values
    _, drops, _, _, _ = aggregate(contributions([honest, scaled * float("nan")]), POLICY)
    assert [drop.reason for drop in drops] == ["non-finite"]


def test_excluded_senders_are_left_out_without_a_new_offence():
    parts = honest_parts(3)
    result, drops, _, _, _ = aggregate(contributions(parts), POLICY, excluded=[0])
    assert [(drop.sender, drop.reason, drop.is_offence) for drop in drops] == [(0, "excluded", False)]
    assert torch.allclose(result, (parts[1] + parts[2]) / 2, atol=1e-6)


def test_all_contributions_dropped_is_an_error_not_a_nan_result():
    parts = [part * float("nan") for part in honest_parts(2)]
    with pytest.raises(NothingToAggregate, match="all 2 contributions were dropped"):
        aggregate(contributions(parts), POLICY)


def test_all_zero_parts_are_kept_and_averaged_to_zero():
    zeros = [torch.zeros(10) for _ in range(4)]
    result, drops, _, _, _ = aggregate(contributions(zeros, [0.0] * 4), POLICY)
    assert drops == [] and torch.equal(result, torch.zeros(10))


def test_direction_check_can_be_turned_off():
    parts = honest_parts(4)
    parts[0] = -parts[0]
    _, drops, _, fully_judged, _ = aggregate(contributions(parts), RobustPolicy(min_cosine=-1.0))
    assert drops == [] and fully_judged  # every check that is on ran


@pytest.mark.parametrize("rule", ["trimmed-mean", "centered-clip"])
def test_robust_rules_stay_near_the_honest_mean_where_a_mean_would_not(rule):
    # a moderate liar (3x, reversed) passes the norm check; the mean moves, the robust rules much less
    parts = honest_parts(5, seed=3)
    honest_mean = weighted_mean(parts[1:], [1] * 4)
    parts[0] = -3 * parts[0]
    policy = RobustPolicy(min_cosine=-1.0, rule=rule)
    robust, _, _, _, _ = aggregate(contributions(parts), policy)
    plain, _, _, _, _ = aggregate(contributions(parts), RobustPolicy(min_cosine=-1.0, rule="mean"))
    assert (robust - honest_mean).norm() < 0.6 * (plain - honest_mean).norm()


def test_a_part_too_small_to_judge_is_combined_robustly_without_a_verdict():
    """A tail part of a few dozen values: a 30x norm among three is no offence there, and its values still cannot
    move the result past the median of three; from MIN_JUDGED_VALUES values on, the same sender is dropped."""
    policy = RobustPolicy()
    small = honest_parts(3, size=policy.min_judged_values - 1)
    small[2] = small[2] * 30
    result, drops, norm_judged, fully_judged, _ = aggregate(contributions(small), policy)
    assert drops == [] and not norm_judged and not fully_judged
    assert torch.equal(result, torch.stack(small).median(dim=0).values)  # trimmed mean of three: their median
    judged = honest_parts(3, size=policy.min_judged_values)
    judged[2] = judged[2] * 30
    _, drops, norm_judged, _, _ = aggregate(contributions(judged), policy)
    assert [(drop.sender, drop.reason) for drop in drops] == [(2, "norm")] and norm_judged


def test_trimmed_mean_of_identical_parts_is_that_part():
    part = torch.randn(50)
    result, _, _, _, _ = aggregate(contributions([part.clone() for _ in range(5)]), RobustPolicy(rule="trimmed-mean"))
    assert torch.allclose(result, part, atol=1e-6)


def verdicts(peer: str, offences, direction_judged: bool = True):
    return [Verdict(peer, f"round{index}", offence, direction_judged=direction_judged)
            for index, offence in enumerate(offences)]


def test_a_peer_is_excluded_once_threshold_offences_fall_within_the_window():
    book = ExclusionBook(ExclusionRule(threshold=3, window=5))
    assert book.record(verdicts("bad", ["norm", "", "norm"])) == []
    excluded = book.record(verdicts("bad", ["direction"]))
    assert [peer for peer, _ in excluded] == ["bad"]
    assert "3 of its last 4 judged rounds" in excluded[0][1] and "direction, norm" in excluded[0][1]
    assert book.excluded == ["bad"]
    assert book.record(verdicts("bad", ["norm"] * 5)) == []  # logged once


def test_rare_or_transient_offences_never_exclude():
    book = ExclusionBook(ExclusionRule(threshold=3, window=5))
    offences = (["non-finite"] + [""] * 4) * 10  # one transient NaN every five rounds, for fifty rounds
    assert book.record(verdicts("honest", offences)) == []
    assert book.excluded == []


def test_an_honest_peers_rare_norm_outliers_in_groups_of_three_never_exclude_it():
    """In groups of three only the norm check runs: its clean rounds count against its outliers. (When they did
    not, an honest peer of a 7-peer swarm was excluded for three outliers over its rounds in groups of three.)"""
    book = ExclusionBook(ExclusionRule(threshold=3, window=10))
    rounds = (["norm"] + [""] * 5) * 10  # an outlier every sixth round, for sixty rounds
    assert book.record(verdicts("honest", rounds, direction_judged=False)) == []
    assert book.excluded == []


def test_a_sign_flipper_is_judged_by_the_rounds_that_could_see_its_direction_only():
    """Its rounds in groups of three are clean (no norm offence) but cannot tell a sign flip: they must not dilute
    the direction offences of its rounds in larger groups."""
    book = ExclusionBook(ExclusionRule(threshold=3, window=10))
    for _ in range(2):
        assert book.record(verdicts("flipper", ["direction"])) == []
        assert book.record(verdicts("flipper", [""] * 6, direction_judged=False)) == []
    excluded = book.record(verdicts("flipper", ["direction"]))
    assert [peer for peer, _ in excluded] == ["flipper"]
    assert "3 of its last 3 rounds that judged its direction were offences (direction" in excluded[0][1]


def test_exclusion_with_a_cool_off_ends():
    now = [0.0]
    book = ExclusionBook(ExclusionRule(threshold=1, window=1, seconds=30.0), clock=lambda: now[0])
    book.record(verdicts("bad", ["norm"]))
    now[0] = 29.0
    assert book.expire() == [] and book.excluded == ["bad"]
    now[0] = 30.0
    assert book.expire() == ["bad"] and book.excluded == []



def test_no_direction_is_judged_where_the_contributions_agree_on_none():
    """Four independent noise vectors (honest single-batch gradients late in training look like this): one of them
    may point away from the others' median by chance, but there is no consensus to judge it against."""
    generator = torch.Generator().manual_seed(3)
    noise = [torch.randn(1000, generator=generator) for _ in range(4)]
    noise[0] = -noise[1] - noise[2]  # points away from two of the others
    _, drops, _, fully_judged, _ = aggregate(contributions(noise), POLICY)
    assert drops == [] and not fully_judged  # unjudged: the senders' exclusion windows do not count it clean
    # the same vector among contributions that agree on a direction is dropped
    agreeing = honest_parts(3, seed=4)
    _, drops, _, fully_judged, _ = aggregate(contributions([-agreeing[0] - agreeing[1], *agreeing]), POLICY)
    assert [(drop.sender, drop.reason) for drop in drops] == [(0, "direction")] and fully_judged


@pytest.mark.parametrize("honest, hostile, reason", [
    (2, 4, "direction"),  # colluders that send one flipped gradient between them: a consensus of their own
    (2, 3, "norm"),  # a vanishing gradient: against its median, the honest ones are outsized
])
def test_a_reducer_never_drops_a_peer_for_disagreeing_with_a_hostile_majority_it_disagrees_with_too(
        honest, hostile, reason):
    """A hostile majority: against its median, the honest contributions are the outliers. An honest reducer, whose
    own contribution the check would drop, judges nothing in that part rather than drop the other honest peer."""
    parts = honest_parts(honest + hostile)
    attack = -1.0 * parts[0] if reason == "direction" else 1e-6 * parts[0]
    parts[honest:] = [attack.clone() for _ in range(hostile)]
    at_a_hostile_reducer = aggregate(contributions(parts), POLICY, own=honest)
    assert {(drop.sender, drop.reason) for drop in at_a_hostile_reducer.drops} == {(0, reason), (1, reason)}
    at_an_honest_reducer = aggregate(contributions(parts), POLICY, own=0)
    assert at_an_honest_reducer.drops == [] and not at_an_honest_reducer.fully_judged
    # where this peer agrees with the majority, the checks run as before; and where it is the outlier alone (a
    # faulty gradient), its own reducer leaves it out too
    parts = honest_parts(5)
    parts[4] = -parts[4]
    for own in (0, 4):
        assert [(drop.sender, drop.reason) for drop in aggregate(contributions(parts), POLICY, own=own).drops] == [
            (4, "direction")]
