"""Robust aggregation: what a reducer does with the contributions it receives for one tensor part.

In hivemind's butterfly all-reduce every peer reduces one part of every averaged tensor and sees each
sender's contribution to that part, with its weight. Instead of averaging whatever arrives, a reducer here:

1. leaves out peers this peer has excluded (no new offence: they are already excluded);
2. drops a contribution whose weight is negative or not finite, or whose values hold NaN or Inf;
3. where the averager's weights are sample counts (its pipeline carries a WeightBound), caps each weight at
   `max_share` times an equal share of the target batch among the part's senders, and at what the sender's
   own believed progress records account for (averaging/pipeline/evidence.py; never below one equal share): a
   sender cannot buy itself the round by claiming samples it never trained on. The capped contribution is still
   used; a claim above OFFENCE_TARGETS whole target batches is an offence (a WeightClaim finding, not a drop);
4. with at least three finite contributions (fewer cannot outvote anyone) to a part of at least
   `min_judged_values` values (see MIN_JUDGED_VALUES), drops one whose L2 norm is
   more than `norm_ratio` times the median of the others' norms; then, with at least four left (the
   median of two others is no center: honest single-batch gradients were dropped that way), one whose
   cosine similarity to the coordinate-wise median of the others is below `min_cosine` (it points away
   from the consensus: a sign flip, or noise passed off as a gradient). Only where there is a consensus:
   if the median of those cosines is below DIRECTION_CONSENSUS, the contributions do not agree on a
   direction (noisy single-batch gradients late in training) and an honest one points away by chance:
   on bytelm-tiny, in up to 6% of parts at one stage of training, which excluded an honest peer). Neither
   check is applied to a part where it would drop the reducer's own contribution together with others: a
   median that this peer and others disagree with may be a hostile majority's, against which the honest
   peers would be dropped and excluded (three sign-flippers among five peers did that);
5. combines what is left with `rule`: the weighted mean (hivemind's own), a coordinate-wise weighted
   trimmed mean (the default: with three or more contributions it trims at least one value from each end
   of every coordinate, so that with three it is their median and one hostile sender of three is
   outvoted), or CenteredClip (Karimireddy et al. 2021, as in BTARD). A contribution of weight 0 (a peer
   tagging along while it downloads state) has no say in the result.

Every drop but the first kind is an offence by its sender, and so is an implausible weight claim, reported so
that repeat offenders can be excluded (averaging/pipeline/exclusion.py). The result depends only on the
contributions, never on the order they arrived in, so a part's result is the same bits wherever it is
reduced. This module is pure torch: the hivemind wiring lives in averaging/adapter/reducer.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import ClassVar, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from averaging.pipeline.evidence import SampleEvidence
from averaging.pipeline.round_pipeline import RoundStage

MIN_SENDERS_FOR_DIRECTION = 4
DIRECTION_CONSENSUS = 0.2
"""The median cosine (each contribution to the median of the others) below which no direction is judged. Measured
on 4 single-batch bytelm-tiny gradients over 7 stages of training: honest parts below min_cosine fell from up to 6.2%
to at most 0.7% of judged parts, and a sign flip is still dropped in 36 to 100% of them (it was 49 to 100%)."""
MIN_JUDGED_VALUES = 256
"""A part smaller than this gets no norm or direction verdict; its values are still combined robustly by `rule`.
hivemind's last part of a peer's span can be a few dozen values (the tail of a bias vector), where honest peers'
gradients differ by chance: in a 7-peer bytelm-tiny swarm an honest peer was excluded for three norm offences, each
in a part of 48 values, at 20x the median of two honest others."""
CENTERED_CLIP_ITERATIONS = 5
OFFENCE_TARGETS = 2.0
"""A weight claim is an offence only above this many whole target batches. The cap (an equal share times
max_share) trims what an honest fast peer counts for, but honest claims can reach the whole target: a peer that
sees the others' progress late accumulates on until the round starts (in a loaded 5-peer swarm on 2 cores, an
honest peer claimed the whole target of 48 in a group of five, where four equal shares are 38). More than the
whole target twice over, a peer can only claim for samples it never trained on, since the round starts once the
swarm has the target."""


@dataclass(frozen=True)
class RobustPolicy:
    norm_ratio: float = 20.0
    min_cosine: float = -0.2  # -1 turns the direction check off
    rule: str = "trimmed-mean"
    trim_fraction: float = 0.25  # with 3 or more contributions, at least one is trimmed from each end
    min_judged_values: int = MIN_JUDGED_VALUES  # smaller parts are combined, not judged


@dataclass(frozen=True)
class WeightBound(RoundStage):
    """The stage of an averager whose weights are sample counts toward the target batch (gradient and
    pseudo-gradient averagers): its reducers cap each weight at `max_share` times an equal share of the target
    among a part's senders. Averagers whose weights are no sample counts (parameter rounds, weighted 1 each by
    hivemind) must not carry it."""

    target_batch_size: int
    max_share: float = 2.0
    evidence: Optional[SampleEvidence] = field(default=None, compare=False)
    """What each sender's believed progress records account for (averaging/pipeline/evidence.py), where the
    training process shares it."""

    def cap(self, senders: int, attributed: Optional[float] = None) -> float:
        """The most weight one of `senders` contributions that claim samples is counted with: `max_share` equal
        shares, and no more than its progress records account for (`attributed`), but never below one share."""
        share = self.target_batch_size / max(1, senders)
        if attributed is None:
            return self.max_share * share
        return min(self.max_share * share, max(share, attributed))

    @property
    def plausible(self) -> float:
        """The most samples one sender can claim without an offence."""
        return OFFENCE_TARGETS * self.target_batch_size


@dataclass(frozen=True)
class Contribution:
    sender: int
    part: torch.Tensor
    weight: float
    attributed: Optional[float] = None  # the samples the sender's progress records account for, where known


@dataclass(frozen=True)
class Drop:
    """A contribution left out of the part's result, and why."""

    sender: int
    reason: str  # "excluded", "weight", "non-finite", "norm" or "direction"
    detail: str = ""

    @property
    def is_offence(self) -> bool:
        return self.reason != "excluded"


@dataclass(frozen=True)
class WeightClaim:
    """A weight above the part's cap: the contribution is used, with the cap as its weight (it is no drop)."""

    sender: int
    claimed: float
    cap: float
    plausible: float  # the most a sender can claim without an offence: OFFENCE_TARGETS target batches
    reason: ClassVar[str] = "weight-claim"

    @property
    def is_offence(self) -> bool:
        return self.claimed > self.plausible

    @property
    def detail(self) -> str:
        return f"claimed {self.claimed:.0f} samples, counted {self.cap:.0f}, at most {self.plausible:.0f} plausible"


Finding = Union[Drop, WeightClaim]
"""What a reducer found about one sender's contribution to a part (each has sender, reason, detail, is_offence)."""


class Aggregate(NamedTuple):
    result: torch.Tensor
    drops: List[Drop]
    norm_judged: bool  # the norm check ran (False: fewer than three contributions, a small part, or not applied)
    fully_judged: bool  # every check that is on ran (False: too few contributions, a small part, no consensus)
    capped: List[WeightClaim]  # weights capped to the bound (the contribution is used, unless a check drops it)


class NothingToAggregate(RuntimeError):
    """Every contribution to a part was dropped: the round cannot produce an honest result."""


def aggregate(contributions: Sequence[Contribution], policy: RobustPolicy, excluded: Sequence[int] = (),
              bound: Optional[WeightBound] = None, own: Optional[int] = None) -> Aggregate:
    """Combine the contributions to one part; return the result, what was dropped and why, whether the norm
    check ran (with three or more contributions to a part of at least `policy.min_judged_values`), whether every
    check that is on could run (with fewer than four contributions, or no consensus on a direction, a sign flip
    would have gone unseen), and whose weight was capped (where `bound` is given: the weights are sample counts).
    `own` is the sender that is this peer, whose contribution it trusts."""
    contributions = sorted(contributions, key=lambda item: item.sender)  # arrival order must not change a bit
    senders = sum(1 for item in contributions if _claims_samples(item))
    drops: List[Drop] = []
    capped: List[WeightClaim] = []
    kept: List[Contribution] = []
    for item in contributions:
        drop = _screen(item, excluded)
        if drop is not None:
            drops.append(drop)
            continue
        cap = None if bound is None else bound.cap(senders, item.attributed)
        if cap is not None and item.weight > cap:
            capped.append(WeightClaim(item.sender, item.weight, cap, bound.plausible))
            item = replace(item, weight=cap)
        kept.append(item)
    norm_judged = fully_judged = False
    if len(kept) >= 3 and kept[0].part.numel() >= policy.min_judged_values:
        kept, outliers, norm_judged, fully_judged = _drop_outliers(kept, policy, own)
        drops += outliers
    if not kept:
        raise NothingToAggregate(f"all {len(contributions)} contributions were dropped: {_describe(drops)}")
    return Aggregate(_combine(kept, policy), drops, norm_judged, fully_judged, capped)


def _claims_samples(item: Contribution) -> bool:
    # the senders a target's samples are shared among: a peer tagging along at weight 0 claims no share of them
    return math.isfinite(item.weight) and item.weight > 0


def _screen(item: Contribution, excluded: Sequence[int]) -> Optional[Drop]:
    if item.sender in excluded:
        return Drop(item.sender, "excluded")
    if not math.isfinite(item.weight) or item.weight < 0:
        return Drop(item.sender, "weight", f"weight {item.weight}")
    if not bool(torch.isfinite(item.part).all()):
        return Drop(item.sender, "non-finite", "values hold NaN or Inf")
    return None


def _drop_outliers(kept: List[Contribution], policy: RobustPolicy,
                   own: Optional[int]) -> Tuple[List[Contribution], List[Drop], bool, bool]:
    """The norm check, then the direction check, and whether each ran. A check that would drop `own` (this peer's
    contribution) together with others is not applied to the part: what it judges against, the others' median, is
    then not one this peer can trust (a hostile majority's), and the honest peers that agree with this one would be
    dropped, and excluded, with it. A check that would drop `own` alone applies: this peer is the outlier (a faulty
    gradient must not reach the swarm through its own reducer)."""
    norms = torch.stack([item.part.double().norm() for item in kept])
    survivors, drops = [], []
    for index, item in enumerate(kept):
        others = torch.cat([norms[:index], norms[index + 1:]])
        typical = float(others.quantile(0.5))  # with two others, their mean (torch's median takes the lower)
        if typical > 0 and float(norms[index]) > policy.norm_ratio * typical:
            drops.append(Drop(item.sender, "norm", f"norm {float(norms[index]):.3g} vs median {typical:.3g} "
                                                   f"in a part of {item.part.numel()} values"))
        else:
            survivors.append(item)
    if _among_others(own, [drop.sender for drop in drops]):
        return kept, [], False, False
    if policy.min_cosine <= -1.0:
        return survivors, drops, True, True  # every check that is on has run
    if len(survivors) < MIN_SENDERS_FOR_DIRECTION:
        return survivors, drops, True, False
    cosines = _cosines_to_the_others(survivors)
    judged = [cosine for cosine in cosines if cosine is not None]
    if not judged or float(torch.tensor(judged).quantile(0.5)) < DIRECTION_CONSENSUS:
        return survivors, drops, True, False  # no direction the contributions agree on: nothing to judge against
    away = [item.sender for item, cosine in zip(survivors, cosines)
            if cosine is not None and cosine < policy.min_cosine]
    if _among_others(own, away):
        return survivors, drops, True, False
    kept = []
    for item, cosine in zip(survivors, cosines):
        if item.sender in away:
            drops.append(Drop(item.sender, "direction", f"cosine {cosine:.2f} to the others' median"))
        else:
            kept.append(item)
    return kept, drops, True, True


def _among_others(own: Optional[int], dropped: List[int]) -> bool:
    return own in dropped and len(dropped) > 1


def _cosines_to_the_others(items: List[Contribution]) -> List[Optional[float]]:
    """Each contribution's cosine similarity to the coordinate-wise median of the others (None: a zero vector,
    such as a part nobody has a gradient for yet, has no direction)."""
    stacked = torch.stack([item.part.flatten().float() for item in items])
    cosines: List[Optional[float]] = []
    for index in range(len(items)):
        center = torch.cat([stacked[:index], stacked[index + 1:]]).median(dim=0).values
        if float(center.norm()) == 0 or float(stacked[index].norm()) == 0:
            cosines.append(None)
        else:
            cosines.append(float(torch.nn.functional.cosine_similarity(stacked[index], center, dim=0)))
    return cosines


def _combine(kept: List[Contribution], policy: RobustPolicy) -> torch.Tensor:
    shape, dtype = kept[0].part.shape, kept[0].part.dtype
    # weight 0 has no say: in a median, a peer tagging along with stale or zero values would otherwise be the
    # middle value wherever the others disagree in sign (the weighted mean is the same bits either way)
    voters = [item for item in kept if item.weight > 0] or kept
    values = torch.stack([item.part.flatten().float() for item in voters])
    weights = torch.tensor([item.weight for item in voters], dtype=torch.float32)
    if float(weights.sum()) == 0:
        weights = torch.ones_like(weights)  # nobody accumulated samples: a plain mean, not a division by zero
    if policy.rule == "trimmed-mean":
        result = _trimmed_mean(values, weights, policy.trim_fraction)
    elif policy.rule == "centered-clip":
        result = _centered_clip(values, weights)
    else:
        result = _weighted_mean(values, weights)
    return result.reshape(shape).to(dtype)


def _weighted_mean(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (values * weights[:, None]).sum(0) / weights.sum()


def trimmed_count(count: int, trim_fraction: float) -> int:
    """How many values the trimmed mean leaves out at each end of a coordinate, of `count`: none of two or fewer
    (two cannot outvote each other), else `trim_fraction` of them but at least one (of three: their median)."""
    if count < 3:
        return 0
    return min(max(1, int(count * trim_fraction)), (count - 1) // 2)


def _trimmed_mean(values: torch.Tensor, weights: torch.Tensor, trim_fraction: float) -> torch.Tensor:
    """Per coordinate: leave out the `trim` largest and smallest values, weighted mean of the rest."""
    count = values.shape[0]
    trim = trimmed_count(count, trim_fraction)
    if trim == 0:
        return _weighted_mean(values, weights)
    ordered, order = values.sort(dim=0, stable=True)  # ties in sender order, whatever the platform
    if count - 2 * trim == 1:
        return ordered[trim]  # the median itself, bit for bit (a weighted mean of one value may round)
    ordered_weights = weights[order]
    middle = slice(trim, count - trim)
    middle_weights = ordered_weights[middle]
    total = middle_weights.sum(0)
    plain = ordered[middle].mean(0)  # where every kept weight is zero
    weighted = (ordered[middle] * middle_weights).sum(0) / total.clamp_min(1e-30)
    return torch.where(total > 0, weighted, plain)


def _centered_clip(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """CenteredClip from the coordinate-wise median: each step moves the center by the weighted mean of the
    contributions' offsets, each offset clipped to the median offset length (so no sender moves it far)."""
    center = values.median(dim=0).values
    shares = weights / weights.sum()
    for _ in range(CENTERED_CLIP_ITERATIONS):
        offsets = values - center
        lengths = offsets.norm(dim=1)
        radius = lengths.median()
        if float(radius) == 0:
            break
        scale = torch.clamp(radius / lengths.clamp_min(1e-30), max=1.0)
        center = center + (offsets * (shares * scale)[:, None]).sum(0)
    return center


def _describe(drops: Sequence[Drop]) -> str:
    return "; ".join(f"sender {drop.sender}: {drop.reason}" for drop in drops)
