"""Adaptive deadlines: matchmaking time and averaging timeout chosen per round from measurements.

hivemind takes both as constants. A timeout that is too short fails every round on a slow
link; one that is too long makes every round with a dead peer cost that long. So, when the
user asks for 'auto':
- averaging timeout = clamp(timeout_factor x the slowest of the last `window` ok rounds);
  a round that timed out counts as `timeout_growth` x the timeout it hit, so the deadline
  grows until rounds fit in it again;
- matchmaking time = clamp(matchmaking_fraction x the expected epoch time), where the epoch
  time is target_batch_size / the swarm's samples per second: a slow swarm can afford to wait
  longer for stragglers, a fast one cannot;
- an auto timeout is never below 2 x the matchmaking time, even above its upper bound
  (hivemind asserts that a round's deadline comes after its matchmaking).

This is a pure class: no clock, no hivemind, no logging. The optimizer feeds it measurements
and applies what it returns.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Deque, Optional


def clamp(value: float, low: float, high: float) -> float:
    return min(high, max(low, value))


@dataclass(frozen=True)
class Deadlines:
    matchmaking_seconds: float
    averaging_timeout_seconds: float


class AdaptiveDeadlines:
    """Chooses deadlines within bounds; a fixed (non-auto) deadline is passed through unchanged.

    :param matchmaking_seconds: a fixed value, or None for auto
    :param averaging_timeout_seconds: a fixed value, or None for auto
    """

    def __init__(
        self,
        *,
        matchmaking_seconds: Optional[float],
        averaging_timeout_seconds: Optional[float],
        matchmaking_bounds: tuple = (1.0, 30.0),
        timeout_bounds: tuple = (5.0, 120.0),
        timeout_factor: float = 2.0,
        timeout_growth: float = 1.5,
        matchmaking_fraction: float = 0.1,
        window: int = 8,
    ):
        if not (0 < matchmaking_bounds[0] <= matchmaking_bounds[1] and 0 < timeout_bounds[0] <= timeout_bounds[1]):
            raise ValueError(f"bounds must be 0 < min <= max (got {matchmaking_bounds}, {timeout_bounds})")
        self.fixed_matchmaking, self.fixed_timeout = matchmaking_seconds, averaging_timeout_seconds
        self.matchmaking_bounds, self.timeout_bounds = matchmaking_bounds, timeout_bounds
        self.timeout_factor, self.timeout_growth = timeout_factor, timeout_growth
        self.matchmaking_fraction = matchmaking_fraction
        self._round_seconds: Deque[float] = deque(maxlen=window)
        self._epoch_seconds: Optional[float] = None
        # until something is measured: the widest timeout (never fail a round for lack of data),
        # and the shortest matchmaking (never stall a fast swarm for lack of data)
        self._current = Deadlines(
            matchmaking_seconds if matchmaking_seconds is not None else matchmaking_bounds[0],
            averaging_timeout_seconds if averaging_timeout_seconds is not None else timeout_bounds[1],
        )

    @property
    def auto(self) -> bool:
        return self.fixed_matchmaking is None or self.fixed_timeout is None

    @property
    def current(self) -> Deadlines:
        return self._current

    def observe_round(self, outcome: str, seconds: float) -> None:
        """One averaging round as measured by this peer: ok rounds give their duration, timeouts a lower bound."""
        if outcome == "ok" and seconds > 0:
            self._round_seconds.append(seconds)
        elif outcome == "timeout":
            hit = self._current.averaging_timeout_seconds
            self._round_seconds.append(hit * self.timeout_growth / self.timeout_factor)

    def observe_swarm(self, samples_per_second: float, target_batch_size: int) -> None:
        """The swarm's measured accumulation rate: an epoch should take target_batch_size / rate seconds."""
        if samples_per_second > 0:
            self._epoch_seconds = target_batch_size / samples_per_second

    def update(self) -> Deadlines:
        """Recompute from the measurements so far; returns the deadlines to use for the next round."""
        matchmaking, timeout = self._current.matchmaking_seconds, self._current.averaging_timeout_seconds
        if self.fixed_timeout is None and self._round_seconds:
            timeout = clamp(self.timeout_factor * max(self._round_seconds), *self.timeout_bounds)
        if self.fixed_matchmaking is None and self._epoch_seconds is not None:
            matchmaking = clamp(self.matchmaking_fraction * self._epoch_seconds, *self.matchmaking_bounds)
        if self.fixed_timeout is None and timeout < 2 * matchmaking:
            # hivemind requires a round's deadline to fall after its matchmaking ends; this rule wins over the bounds
            timeout = 2 * matchmaking
        self._current = Deadlines(matchmaking, timeout)
        return self._current
