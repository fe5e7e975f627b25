"""The averaging rounds this process has started, so that a peer can drop those nobody will join.

hivemind looks for a group until a round's timeout: with `--averaging-timeout-seconds auto`
that starts at two minutes. A peer whose partners have left (their progress records outlive
them by a few seconds, so it still schedules rounds) would take that long to stop on Ctrl+C,
once for the gradient round its last step waits on and again for the background
state-averaging round that its final checkpoint waits on. hivemind's own shutdown cancels
rounds still looking for a group, but only after both waits.

averaging/adapter/ records every round started through hivemind's averagers in
this process; a `RoundAbandoner` cancels those still looking for a group after a grace period,
once the peer is leaving, or once every other peer is (a straggler one epoch behind peers that
reached --max-epochs would otherwise wait out a gradient round and a state round that nobody
joins). It also cancels a round that nobody can join any more: rounds meet only rounds that lead
to the same epoch (averaging/adapter/epoch_keys.py), so once every other peer is at that epoch or
past it, a round still looking (a peer the others left one epoch behind) would look until its
timeout; cancelled, it fails at once and the strategy downloads the swarm's state. A cancelled
round fails the way a timed-out one does: the peer goes on with its own gradients or parameters.
Rounds that found their group are left to finish, since their groupmates wait for this peer's part.
"""
from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Callable, List

from hivemind.averaging.control import AveragingStage, StepControl

from averaging import adapter

logger = logging.getLogger(__name__)

class RoundAbandoner(threading.Thread):
    """Cancels rounds that have looked for a group for grace_seconds() or longer, all of them while leaving() is
    true, and each one whose epoch `nobody_joins(epoch)` says no other peer can reach any more."""

    def __init__(self, leaving: Callable[[], bool], grace_seconds: Callable[[], float],
                 nobody_joins: Callable[[int], bool] = lambda epoch: False,
                 poll_seconds: float = 0.25, clock: Callable[[], float] = time.monotonic):
        super().__init__(name="RoundAbandoner", daemon=True)
        self.leaving, self.grace_seconds, self.poll_seconds, self.clock = leaving, grace_seconds, poll_seconds, clock
        self.nobody_joins = nobody_joins
        self._looking_since: "weakref.WeakKeyDictionary[StepControl, float]" = weakref.WeakKeyDictionary()
        self._finished = threading.Event()

    def run(self) -> None:
        while not self._finished.wait(self.poll_seconds):
            self.poll()

    @staticmethod
    def _is_looking(control: StepControl) -> bool:
        return not control.done() and control.stage == AveragingStage.LOOKING_FOR_GROUP

    def _looking(self) -> list:
        return [control for control in list(adapter.open_rounds) if self._is_looking(control)]

    def finish(self, timeout_seconds: float = 1.0) -> None:
        self._finished.set()
        if self.is_alive():
            self.join(timeout_seconds)

    def poll(self) -> int:
        """One pass: cancel the overdue rounds that nobody will join; return how many.

        leaving() and nobody_joins() may read the DHT, so they are asked only once a round has looked longer than
        the grace: a round normally finds its group within its matchmaking window, and then nothing is read."""
        now, grace = self.clock(), self.grace_seconds()
        overdue = [control for control in self._looking()
                   if now - self._looking_since.setdefault(control, now) >= grace]
        if not overdue:
            return 0
        if self.leaving():
            doomed, why = overdue, "this peer is leaving, or every other peer is"
        else:
            doomed, why = self._orphaned(overdue), "every other peer is past the epoch they lead to"
        # the DHT reads may have taken a while: a round that found its group meanwhile runs on
        cancelled = sum(1 for control in doomed if self._is_looking(control) and control.cancel())
        if cancelled:
            logger.info(f"abandoned {cancelled} averaging round(s) that found no group within {grace:.0f}s ({why})")
        return cancelled

    def _orphaned(self, rounds: List[StepControl]) -> List[StepControl]:
        return [control for control in rounds
                if (epoch := adapter.round_epoch(control)) is not None and self.nobody_joins(epoch)]
