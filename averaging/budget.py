"""An upload budget (--max-upload-mbit): the arithmetic that turns what a peer's rounds cost into the round factor
it asks the swarm for.

A DiLoCo round is one global epoch: it starts when the swarm has accumulated factor x --target-batch-size samples,
so the factor k sets how often a peer uploads its round's bytes. Over one epoch at factor k a peer spends
k x t seconds training (t: the wall time the swarm takes per target batch) and r seconds in the round (what the
round blocks training; with --diloco-overlap, little), and it uploads B bytes. Its upload rate is

    rate(k) = B / (k x t + r)

and the smallest k in [1, --max-round-factor] with rate(k) <= budget is the factor it needs. A budget that even
--max-round-factor cannot meet is reported (`Choice.meets`). A factor goes up as soon as the budget needs it, and
down only once the lower factor would still leave DECREASE_HEADROOM of the budget free, so that it does not flap
between two factors on noisy timings.

This module is pure: no torch, no hivemind, no clock of its own (callers pass the time). What the swarm agrees on
from every peer's request is averaging/swarm/round_factor.py's; DiLoCo wires both in
averaging/strategies/round_length.py.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Deque, Optional, Tuple

BYTES_PER_MBIT = 1e6 / 8
DECREASE_HEADROOM = 0.8
"""A lower factor is taken only if its rate stays within this share of the budget."""
WINDOW_SECONDS = 60.0
"""The budget holds over a minute: the rate is measured over at least this long."""
TIMING_EPOCHS = 4
"""How many recent epochs the timings are the median of."""


@dataclass(frozen=True)
class RoundCost:
    """What one epoch costs this peer."""

    bytes_per_round: float
    """What it uploads in one round."""
    train_seconds: float
    """Wall seconds per target batch of training (an epoch at factor k trains k times as long)."""
    round_seconds: float
    """Wall seconds the round itself takes out of training, whatever the factor."""

    def epoch_seconds(self, factor: int) -> float:
        return factor * self.train_seconds + self.round_seconds

    def mbit(self, factor: int) -> float:
        """The upload rate at `factor`, in Mbit/s."""
        return self.bytes_per_round / BYTES_PER_MBIT / max(1e-9, self.epoch_seconds(factor))


@dataclass(frozen=True)
class Choice:
    factor: int
    """The factor to ask for, in [1, max_factor]."""
    meets: bool
    """Whether the budget holds at that factor (if not, the factor is max_factor)."""
    mbit: float
    """The upload rate at that factor."""


def smallest_factor(cost: RoundCost, budget_mbit: float, max_factor: int) -> Optional[int]:
    """The smallest factor in [1, max_factor] whose rate is within `budget_mbit`; None if not even max_factor's."""
    if cost.mbit(max_factor) > budget_mbit:
        return None
    if cost.train_seconds <= 0:  # the rate does not depend on the factor
        return 1
    needed = (cost.bytes_per_round / (budget_mbit * BYTES_PER_MBIT) - cost.round_seconds) / cost.train_seconds
    factor = min(max_factor, max(1, math.ceil(needed)))
    while factor > 1 and cost.mbit(factor - 1) <= budget_mbit:  # rounding: never more than needed
        factor -= 1
    while factor < max_factor and cost.mbit(factor) > budget_mbit:
        factor += 1
    return factor


def choose_factor(cost: RoundCost, budget_mbit: float, current: int, max_factor: int,
                  headroom: float = DECREASE_HEADROOM) -> Choice:
    """The factor to ask for next, from the one asked for now (`current`): up at once where the budget needs it,
    down only where the lower factor leaves `headroom` of the budget free."""
    current = min(max_factor, max(1, current))
    up = smallest_factor(cost, budget_mbit, max_factor)
    if up is None:
        return Choice(max_factor, False, cost.mbit(max_factor))
    factor = up if up > current else current
    down = smallest_factor(cost, budget_mbit * headroom, max_factor)
    if up <= current and down is not None and down < current:
        factor = down
    return Choice(factor, True, cost.mbit(factor))


class CostEstimate:
    """What this peer's rounds cost, from its recent epochs: the bytes of its last round that averaged with others,
    and the median timings of the last TIMING_EPOCHS epochs."""

    def __init__(self, epochs: int = TIMING_EPOCHS):
        self.bytes_per_round: Optional[float] = None
        self._train: Deque[float] = deque(maxlen=epochs)
        self._round: Deque[float] = deque(maxlen=epochs)

    def observe_round(self, uploaded_bytes: int) -> None:
        """A round that averaged with others uploaded this much (alone, or failed, it says nothing of the cost)."""
        self.bytes_per_round = float(uploaded_bytes)

    def observe_epoch(self, train_seconds: float, round_seconds: float, factor: int) -> None:
        """One epoch at `factor`: its training took `train_seconds`, its round blocked for `round_seconds`."""
        self._train.append(max(0.0, train_seconds) / max(1, factor))
        self._round.append(max(0.0, round_seconds))

    def cost(self) -> Optional[RoundCost]:
        """None until a round has averaged with others and an epoch has been timed."""
        if self.bytes_per_round is None or not self._train:
            return None
        return RoundCost(self.bytes_per_round, statistics.median(self._train), statistics.median(self._round))


class UploadMeter:
    """The upload rate of a peer's rounds over the last minute, or over its last round interval where rounds are
    further apart (then a minute would hold one round or none)."""

    def __init__(self, started: float, window_seconds: float = WINDOW_SECONDS):
        self.window_seconds, self.started = window_seconds, started
        self._rounds: Deque[Tuple[float, int]] = deque()  # (when it ended, bytes it uploaded)
        self._interval = 0.0

    def record(self, now: float, uploaded_bytes: int) -> None:
        if self._rounds:
            self._interval = now - self._rounds[-1][0]
        self._rounds.append((now, max(0, uploaded_bytes)))
        self._forget(now)

    def mbit(self, now: float) -> float:
        self._forget(now)
        window = self._window(now)
        return sum(sent for _, sent in self._rounds) / BYTES_PER_MBIT / window

    def _window(self, now: float) -> float:
        return max(1e-9, min(max(self.window_seconds, self._interval), max(1e-9, now - self.started)))

    def _forget(self, now: float) -> None:
        window = max(self.window_seconds, self._interval)
        while self._rounds and self._rounds[0][0] <= now - window:
            self._rounds.popleft()
