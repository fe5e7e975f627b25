"""The weight bound (claimed samples capped at a fair share of the target, far above it an offence) and the default
rule (a trimmed mean that is the median of three and the weighted mean of two), issue 31."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from averaging.config import AveragingConfig
from averaging.pipeline.defence import Defence, Verdict
from averaging.pipeline.evidence import EVIDENCE_MARGIN, SampleEvidence
from averaging.pipeline.exclusion import ExclusionBook, ExclusionRule, ExclusionWatch
from averaging.pipeline.robust import (
    OFFENCE_TARGETS,
    Contribution,
    RobustPolicy,
    WeightBound,
    WeightClaim,
    aggregate,
    trimmed_count,
)
from averaging.swarm.claims import ClaimFilter
from tests.peers import wait_until
from tests.unit.test_robust_aggregation import contributions, honest_parts, weighted_mean

TARGET = 48
BOUND = WeightBound(TARGET, max_share=2.0)
MEAN = RobustPolicy(rule="mean")


def test_the_config_defaults_are_the_policys_and_the_bounds():
    config = AveragingConfig()
    policy = RobustPolicy()
    assert (config.robust_aggregation, config.robust_trim_fraction) == (policy.rule, policy.trim_fraction) == (
        "trimmed-mean", 0.25)
    assert (config.robust_norm_ratio, config.robust_min_cosine) == (policy.norm_ratio, policy.min_cosine)
    assert config.robust_max_weight_share == WeightBound(TARGET).max_share == 2.0


def test_a_claim_far_above_the_bound_is_capped_used_and_an_offence():
    parts = honest_parts(3)
    result, drops, _, _, capped = aggregate(contributions(parts, [16.0, 16.0, 160.0]), MEAN, bound=BOUND)
    assert drops == []  # used, not dropped
    assert capped == [WeightClaim(2, 160.0, 32.0, 96.0)]  # 2 x 48 / 3 senders; twice the target
    assert capped[0].is_offence and capped[0].reason == "weight-claim"
    assert capped[0].detail == "claimed 160 samples, counted 32, at most 96 plausible"
    assert torch.allclose(result, weighted_mean(parts, [16.0, 16.0, 32.0]), atol=1e-6)


def test_a_claim_just_above_the_bound_is_capped_but_no_offence():
    _, _, _, _, capped = aggregate(contributions(honest_parts(3), [8.0, 8.0, 40.0]), MEAN, bound=BOUND)
    assert capped == [WeightClaim(2, 40.0, 32.0, 96.0)] and not capped[0].is_offence


@pytest.mark.parametrize("senders", range(2, 17))
@pytest.mark.parametrize("speedup", [3.0, 4.0])
def test_an_honest_peer_up_to_four_times_as_fast_as_the_others_is_never_an_offender(senders, speedup):
    # each claims its share of the target by its speed (what hivemind's progress tracker makes of honest peers)
    speeds = [1.0] * (senders - 1) + [speedup]
    claims = [TARGET * speed / sum(speeds) for speed in speeds]
    _, drops, _, _, capped = aggregate(contributions(honest_parts(senders), claims), MEAN, bound=BOUND)
    assert drops == [] and not any(claim.is_offence for claim in capped), capped


@pytest.mark.parametrize("senders", range(2, 17))
def test_an_honest_peer_that_accumulated_the_whole_target_alone_is_no_offender_in_any_group(senders):
    # it saw the others' progress late: its claim is the whole target, theirs one batch each
    claims = [float(TARGET)] + [16.0] * (senders - 1)
    _, _, _, _, capped = aggregate(contributions(honest_parts(senders), claims), MEAN, bound=BOUND)
    assert not any(claim.is_offence for claim in capped), capped


def test_only_senders_that_claim_samples_share_the_target():
    # a peer tagging along at weight 0 (downloading state) claims no share: the two others may claim 48 each
    _, _, _, _, capped = aggregate(contributions(honest_parts(3), [48.0, 48.0, 0.0]), MEAN, bound=BOUND)
    assert capped == []


def test_without_a_bound_weights_are_not_capped():
    # an averager whose weights are no sample counts (parameter rounds) carries no WeightBound
    _, _, _, _, capped = aggregate(contributions(honest_parts(3), [1.0, 1.0, 1e9]), MEAN)
    assert capped == []


def test_an_excluded_over_claimer_is_left_out_without_a_new_offence():
    _, drops, _, _, capped = aggregate(contributions(honest_parts(3), [16.0, 16.0, 1e6]), MEAN, excluded=[2],
                                    bound=BOUND)
    assert [(drop.sender, drop.reason) for drop in drops] == [(2, "excluded")] and capped == []


def test_the_offence_limit_is_twice_the_target_and_what_the_detail_says():
    assert BOUND.plausible == OFFENCE_TARGETS * TARGET == 96.0
    claim = WeightClaim(0, claimed=BOUND.plausible + 1, cap=32.0, plausible=BOUND.plausible)
    assert claim.is_offence and "at most 96 plausible" in claim.detail
    assert not WeightClaim(0, claimed=BOUND.plausible, cap=32.0, plausible=BOUND.plausible).is_offence


@pytest.mark.parametrize("count, trimmed", [(1, 0), (2, 0), (3, 1), (4, 1), (5, 1), (7, 1), (8, 2), (12, 3)])
def test_the_trimmed_mean_trims_at_least_one_of_three_or_more(count, trimmed):
    assert trimmed_count(count, 0.25) == trimmed
    assert trimmed_count(count, 0.0) == min(trimmed, 1)


def test_one_sign_flipped_over_claimer_of_three_does_not_move_the_result_outside_the_honest_values():
    honest = honest_parts(2, seed=5)
    hostile = -3 * honest[0]  # within the norm bound (3x), flipped, and claiming ten times its batch
    weights = [16.0, 16.0, 160.0]
    result, drops, _, _, capped = aggregate(contributions([*honest, hostile], weights), RobustPolicy(), bound=BOUND)
    assert drops == [] and [claim.sender for claim in capped] == [2]
    low, high = torch.minimum(*honest), torch.maximum(*honest)
    assert bool(((low <= result) & (result <= high)).all())  # coordinate-wise, the median: an honest value
    assert torch.equal(result, torch.stack([*honest, hostile]).median(dim=0).values)
    mean, _, _, _, _ = aggregate(contributions([*honest, hostile], weights), MEAN, bound=BOUND)
    assert not bool(((low <= mean) & (mean <= high)).all())  # what the old default made of it


def test_the_default_rule_of_two_is_their_weighted_mean():
    parts, weights = honest_parts(2), [10.0, 30.0]
    result, _, _, _, _ = aggregate(contributions(parts, weights), RobustPolicy())
    assert torch.allclose(result, weighted_mean(parts, weights), atol=1e-6)


def test_a_contribution_of_weight_zero_has_no_say_in_the_median():
    parts = honest_parts(2)
    stale = torch.zeros_like(parts[0])  # a peer tagging along at weight 0 while it downloads state
    result, _, _, _, _ = aggregate(contributions([*parts, stale], [16.0, 16.0, 0.0]), RobustPolicy())
    assert torch.allclose(result, weighted_mean(parts, [16.0, 16.0]), atol=1e-6)


@pytest.mark.parametrize("rule", ["mean", "trimmed-mean", "centered-clip"])
def test_the_result_does_not_depend_on_the_order_contributions_arrived_in(rule):
    items = contributions(honest_parts(5, seed=7), [3.0, 1.0, 4.0, 1.0, 5.0])
    expected, _, _, _, _ = aggregate(items, RobustPolicy(rule=rule), bound=BOUND)
    for seed in range(5):
        shuffled = list(items)
        random.Random(seed).shuffle(shuffled)
        result, _, _, _, _ = aggregate(shuffled, RobustPolicy(rule=rule), bound=BOUND)
        assert torch.equal(result, expected)


def test_ties_keep_the_trimmed_mean_deterministic():
    # equal values at the trimmed end with different weights: which one is trimmed must not vary
    parts = [torch.tensor([1.0]), torch.tensor([1.0]), torch.tensor([3.0]), torch.tensor([4.0])]
    weights = [1.0, 10.0, 1.0, 1.0]
    items = [Contribution(index, part, weight) for index, (part, weight) in enumerate(zip(parts, weights))]
    first, _, _, _, _ = aggregate(items, RobustPolicy(min_cosine=-1.0))
    again, _, _, _, _ = aggregate(list(reversed(items)), RobustPolicy(min_cosine=-1.0))
    assert torch.equal(first, again)


def test_repeated_weight_claims_exclude_their_sender():
    book = ExclusionBook(ExclusionRule(threshold=3, window=10))
    detail = "claimed 160 samples, counted 32, at most 96 plausible"
    claims = [Verdict("liar", f"round{index}", "weight-claim", detail) for index in range(3)]
    assert book.record(claims[:2]) == []
    [(peer, why)] = book.record(claims[2:])
    assert peer == "liar" and why == f"3 of its last 3 judged rounds were offences (weight-claim; last: {detail})"


def test_a_weight_claim_is_no_dropped_contribution():
    defence = Defence(RobustPolicy())
    dropped, excluded = [], []
    watch = ExclusionWatch(defence, ExclusionBook(ExclusionRule(threshold=1, window=1)), on_drop=dropped.append,
                           on_exclude=excluded.append)
    try:
        defence.report([Verdict("liar", "round0", "weight-claim", "claimed 160 samples"),
                        Verdict("clumsy", "round0", "non-finite", "values hold NaN or Inf", dropped=True)])
        wait_until(lambda: sorted(excluded) == ["clumsy", "liar"], timeout=10, message="both excluded")
        assert dropped == ["non-finite"]  # peer_dropped_contributions_total counts drops only
    finally:
        watch.close()


# --- what the swarm can attribute to a sender (averaging/pipeline/evidence.py) ---------------------------------------


def test_the_evidence_is_what_a_senders_believed_records_account_for_by_now_shared_with_the_averagers():
    clock = [100.0]
    evidence = SampleEvidence(clock=lambda: clock[0])
    assert evidence.attributed("aa") is None  # nothing recorded yet
    evidence.record({"aa": (16.0, 8.0, 99.0), "bb": (0.0, 0.0, 100.0)})
    assert evidence.attributed("aa") == EVIDENCE_MARGIN * (16.0 + 8.0 * 1.0)
    clock[0] = 103.0
    assert evidence.attributed("aa") == EVIDENCE_MARGIN * (16.0 + 8.0 * 4.0)
    assert evidence.attributed("bb") == 0.0 and evidence.attributed("cc") is None
    evidence.record({})
    assert evidence.attributed("aa") is None  # replaced, not merged: a peer whose records lapsed has no evidence
    many = {f"{index:064x}": (1.0, 1.0, float(index)) for index in range(20000)}  # more than the table holds
    evidence.record(many)
    assert evidence.attributed(f"{19999:064x}") is not None and evidence.attributed(f"{0:064x}") is None


def test_a_sender_is_capped_at_what_its_records_account_for_but_never_below_an_equal_share():
    parts = honest_parts(3)
    # it claims 30 (within twice an equal share of 48/3 = 16: no cap without evidence), its records account for 20
    items = [Contribution(0, parts[0], 16.0), Contribution(1, parts[1], 16.0), Contribution(2, parts[2], 30.0, 20.0)]
    _, _, _, _, capped = aggregate(items, MEAN, bound=BOUND)
    assert capped == [WeightClaim(2, 30.0, 20.0, 96.0)] and not capped[0].is_offence
    # records written at start-up account for nothing yet: an equal share is still counted
    items[2] = Contribution(2, parts[2], 30.0, 0.0)
    assert aggregate(items, MEAN, bound=BOUND).capped == [WeightClaim(2, 30.0, 16.0, 96.0)]
    # records that account for more than the fair-share bound do not raise it
    items[2] = Contribution(2, parts[2], 40.0, 500.0)
    assert aggregate(items, MEAN, bound=BOUND).capped == [WeightClaim(2, 40.0, 32.0, 96.0)]


def test_the_claim_filter_tells_what_the_believed_records_say_in_this_machines_clock():
    told = []
    claims = ClaimFilter(b"me", TARGET, max_ttl_seconds=40.0, max_clock_skew_seconds=5.0, believed=told.append)

    def record(peer_id: bytes, samples: int, rate: float):
        value = dict(peer_id=peer_id, epoch=0, samples_accumulated=samples, samples_per_second=rate, time=1000.0,
                     client_mode=False)
        return SimpleNamespace(value=value, expiration_time=1030.0)

    claims.filter({b"me": record(b"\x01", 8, 4.0), b"other": record(b"\x02", 16, 8.0),
                   b"absurd": record(b"\x03", 10**12, 8.0)}, now=1000.0)
    assert told == [{"02": (16.0, 8.0, 1000.0)}]  # not its own, nor a record it does not believe
