"""Robust aggregation: what a reducer does with the contributions it receives for one tensor part.

In hivemind's butterfly all-reduce every peer reduces one part of every averaged tensor and sees each
sender's contribution to that part. Instead of averaging whatever arrives, a reducer here:

1. leaves out peers this peer has excluded (no new offence: they are already excluded);
2. drops a contribution whose weight is negative or not finite, or whose values hold NaN or Inf;
3. with at least three finite contributions (fewer cannot outvote anyone), drops one whose L2 norm is
   more than `norm_ratio` times the median of the others' norms; then, with at least four left (the
   median of two others is no center: honest single-batch gradients were dropped that way), one whose
   cosine similarity to the coordinate-wise median of the others is below `min_cosine` (it points away
   from the consensus: a sign flip, or noise passed off as a gradient). Only where there is a consensus:
   if the median of those cosines is below DIRECTION_CONSENSUS, the contributions do not agree on a
   direction (noisy single-batch gradients late in training) and an honest one points away by chance:
   on bytelm-tiny, in up to 6% of parts at one stage of training, which excluded an honest peer);
4. combines what is left with `rule`: the weighted mean (hivemind's own), a coordinate-wise weighted
   trimmed mean, or CenteredClip (Karimireddy et al. 2021, as in BTARD).

Every drop but the first kind is an offence by its sender, reported so that repeat offenders can be
excluded (averaging/pipeline/exclusion.py). This module is pure torch: the hivemind wiring lives in
averaging/adapter/reducer.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch

MIN_SENDERS_FOR_DIRECTION = 4
DIRECTION_CONSENSUS = 0.2
"""The median cosine (each contribution to the median of the others) below which no direction is judged. Measured
on 4 single-batch bytelm-tiny gradients over 7 stages of training: honest parts below min_cosine fell from up to 6.2%
to at most 0.7% of judged parts, and a sign flip is still dropped in 36 to 100% of them (it was 49 to 100%)."""
CENTERED_CLIP_ITERATIONS = 5


@dataclass(frozen=True)
class RobustPolicy:
    norm_ratio: float = 20.0
    min_cosine: float = -0.2  # -1 turns the direction check off
    rule: str = "mean"
    trim_fraction: float = 0.25


@dataclass(frozen=True)
class Contribution:
    sender: int
    part: torch.Tensor
    weight: float


@dataclass(frozen=True)
class Drop:
    sender: int
    reason: str  # "excluded", "weight", "non-finite", "norm" or "direction"
    detail: str = ""

    @property
    def is_offence(self) -> bool:
        return self.reason != "excluded"


class Aggregate(NamedTuple):
    result: torch.Tensor
    drops: List[Drop]
    fully_judged: bool  # every check that is on ran (False: too few contributions, or no direction consensus)


class NothingToAggregate(RuntimeError):
    """Every contribution to a part was dropped: the round cannot produce an honest result."""


def aggregate(contributions: Sequence[Contribution], policy: RobustPolicy, excluded: Sequence[int] = ()) -> Aggregate:
    """Combine the contributions to one part; return the result, what was dropped and why, and whether
    every check that is on could run (with fewer than four contributions, or no consensus on a direction,
    a sign flip would have gone unseen)."""
    drops: List[Drop] = []
    kept: List[Contribution] = []
    for item in contributions:
        drop = _screen(item, excluded)
        (drops.append(drop) if drop else kept.append(item))
    fully_judged = False
    if len(kept) >= 3:
        kept, outliers, fully_judged = _drop_outliers(kept, policy)
        drops += outliers
    if not kept:
        raise NothingToAggregate(f"all {len(contributions)} contributions were dropped: {_describe(drops)}")
    return Aggregate(_combine(kept, policy), drops, fully_judged)


def _screen(item: Contribution, excluded: Sequence[int]) -> Optional[Drop]:
    if item.sender in excluded:
        return Drop(item.sender, "excluded")
    if not math.isfinite(item.weight) or item.weight < 0:
        return Drop(item.sender, "weight", f"weight {item.weight}")
    if not bool(torch.isfinite(item.part).all()):
        return Drop(item.sender, "non-finite", "values hold NaN or Inf")
    return None


def _drop_outliers(kept: List[Contribution], policy: RobustPolicy) -> Tuple[List[Contribution], List[Drop], bool]:
    drops: List[Drop] = []
    norms = torch.stack([item.part.double().norm() for item in kept])
    survivors = []
    for index, item in enumerate(kept):
        others = torch.cat([norms[:index], norms[index + 1:]])
        typical = float(others.quantile(0.5))  # with two others, their mean (torch's median takes the lower)
        if typical > 0 and float(norms[index]) > policy.norm_ratio * typical:
            drops.append(Drop(item.sender, "norm", f"norm {float(norms[index]):.3g} vs median {typical:.3g}"))
        else:
            survivors.append(item)
    if policy.min_cosine <= -1.0:
        return survivors, drops, True  # every check that is on has run
    if len(survivors) < MIN_SENDERS_FOR_DIRECTION:
        return survivors, drops, False
    cosines = _cosines_to_the_others(survivors)
    judged = [cosine for cosine in cosines if cosine is not None]
    if not judged or float(torch.tensor(judged).quantile(0.5)) < DIRECTION_CONSENSUS:
        return survivors, drops, False  # no direction that the contributions agree on: nothing to judge against
    kept = []
    for item, cosine in zip(survivors, cosines):
        if cosine is not None and cosine < policy.min_cosine:
            drops.append(Drop(item.sender, "direction", f"cosine {cosine:.2f} to the others' median"))
        else:
            kept.append(item)
    return kept, drops, True


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
    values = torch.stack([item.part.flatten().float() for item in kept])
    weights = torch.tensor([item.weight for item in kept], dtype=torch.float32)
    if float(weights.sum()) == 0:
        weights = torch.ones_like(weights)  # nobody accumulated samples: a plain mean, not a division by zero
    if policy.rule == "trimmed-mean":
        result = _trimmed_mean(values, weights, policy.trim_fraction)
    elif policy.rule == "centered-clip":
        result = _centered_clip(values, weights)
    else:
        result = (values * weights[:, None]).sum(0) / weights.sum()
    return result.reshape(shape).to(dtype)


def _trimmed_mean(values: torch.Tensor, weights: torch.Tensor, trim_fraction: float) -> torch.Tensor:
    """Per coordinate: leave out the `trim` largest and smallest values, weighted mean of the rest."""
    count = values.shape[0]
    trim = min(int(count * trim_fraction), (count - 1) // 2)
    if trim == 0:
        return (values * weights[:, None]).sum(0) / weights.sum()
    ordered, order = values.sort(dim=0)
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
