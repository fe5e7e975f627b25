"""DiLoCo's round length: the factor this peer's upload budget asks for, and the swarm's, applied to its tracker.

A DiLoCo outer round ends when the swarm has accumulated factor x --target-batch-size samples. RoundLength:
- measures what this peer's rounds cost: the bytes it uploads in a round with others (the payload counters' own
  arithmetic, averaging/codecs/compression.py), and per epoch the time it trained and the time its round took out
  of training;
- with --max-upload-mbit, chooses the factor it asks for (averaging/budget.py) as it enters each epoch, and says
  once, in one line, when not even --max-round-factor meets the budget (again only after it was met in between);
- publishes the request and agrees on the swarm's factor with the other peers (averaging/swarm/round_factor.py);
- applies the swarm's factor at each epoch it enters, before that epoch's samples count: the tracker's target batch
  becomes factor x --target-batch-size.

With --max-round-factor 1 nothing is published or read: rounds keep the target batch. The outer round, the state and
the weights are averaging/strategies/diloco.py's; this module must not know about metrics or the CLI: it reports
through AveragingHooks.round_length.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Collection, Optional

from averaging.api import AveragingHooks, RoundLength, RoundReport
from averaging.budget import CostEstimate, choose_factor
from averaging.codecs.compression import bytes_moved
from averaging.config import AveragingConfig
from averaging.swarm.round_factor import RoundFactorBook, RoundFactorWatch

logger = logging.getLogger(__name__)

WAYS_OUT = ("raise --max-upload-mbit, send less with a smaller codec (--grad-compression int4, or topk), or ask the "
            "run's owner for a longer --max-round-factor")


def unmet_budget_line(budget_mbit: float, needed_mbit: float, max_factor: int) -> str:
    """The one line a peer logs when not even the longest round meets its budget."""
    return (f"--max-upload-mbit {budget_mbit:g}: averaging sends {needed_mbit:.3g} Mbit/s even at the longest round "
            f"the swarm allows (--max-round-factor {max_factor}: {max_factor} x --target-batch-size); {WAYS_OUT}")


class RoundLengthKeeper:
    """One per DiLoCo optimizer; every method but close runs on the training thread."""

    def __init__(self, config: AveragingConfig, dht, key: str, hooks: AveragingHooks, payload_bytes: int,
                 excluded: Callable[[], Collection[str]], ttl_seconds: float, subkey: Optional[bytes] = None,
                 clock: Callable[[], float] = time.monotonic):
        """:param subkey: what this peer signs its record with: its progress tracker's key, as its progress"""
        self.base_target, self.max_factor = config.target_batch_size, config.max_round_factor
        self.budget_mbit = config.max_upload_mbit
        self.hooks, self.payload_bytes, self.clock = hooks, payload_bytes, clock
        self.book = RoundFactorBook(dht.peer_id.to_base58(), self.max_factor)
        self.watch = (RoundFactorWatch(self.book, dht, key, excluded, ttl_seconds, subkey)
                      if self.max_factor > 1 else None)
        self.estimate = CostEstimate()
        self.factor = 1
        self._meets, self._needed_mbit = True, None
        self._timed = False  # whether this epoch is timed: entered through this peer's round, and never paused
        self._trained_since: Optional[float] = None  # this epoch's first step
        self._round_began: Optional[float] = None

    def start(self) -> None:
        if self.watch is not None:
            self.watch.start()

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()

    def stepping(self) -> None:
        """Before each local step: an epoch is timed from its first step."""
        if self._timed and self._trained_since is None:
            self._trained_since = self.clock()

    def paused(self) -> None:
        """This epoch's time says nothing of the swarm's training any more: it is not timed."""
        self._timed = False

    def round_begins(self) -> None:
        """The swarm reached this epoch's target: read the others' records while the round runs."""
        self._round_began = self.clock()
        if self.watch is not None:
            self.watch.read_soon()

    def round_measured(self, report: RoundReport) -> None:
        """A round's outcome: one that averaged with others tells what a round uploads."""
        if report.outcome in ("ok", "partial") and report.group_size > 1:
            self.estimate.observe_round(bytes_moved(self.payload_bytes, report.group_size, report.outcome))

    def enter(self, epoch: int, tracker, trained: bool) -> int:
        """This peer enters `epoch` (the caller holds tracker.pause_updates()): `trained`: through its own round,
        else by a download, a checkpoint or at the start. Returns the epoch's factor, applied to `tracker`."""
        now = self.clock()
        if trained and self._timed and self._trained_since is not None and self._round_began is not None:
            self.estimate.observe_epoch(self._round_began - self._trained_since, now - self._round_began, self.factor)
            self._choose()
        # an epoch entered otherwise (the start, a download) began before this peer trained in it: not timed
        self._timed, self._trained_since, self._round_began = trained, None, None
        factor = 1
        if self.watch is not None:
            # through its own round, the records read as the round began (or before) suffice: what they say
            # applies two epochs on, so training never waits on the DHT here. An epoch it did not train into
            # (the start, a download, a checkpoint) is the others' to say: it reads them first
            if not (trained and self.book.read_once):
                self.watch.read_now()
            factor = self.book.enter(epoch)
            self.watch.publish_now()
        if factor != self.factor:
            logger.info(f"rounds are {factor} x --target-batch-size from epoch {epoch} on (the swarm's round factor, "
                        f"was {self.factor})")
        self.factor = factor
        tracker.target_batch_size = self.base_target * factor
        claims = getattr(tracker, "claims", None)
        if claims is not None:  # an epoch's honest claims reach this many target batches, no more
            claims.longest_round = factor
        self.hooks.round_length(RoundLength(epoch=epoch, factor=factor, requested=self.book.requested,
                                            max_factor=self.max_factor, budget_mbit=self.budget_mbit,
                                            meets_budget=self._meets, needed_mbit=self._needed_mbit))
        return factor

    def _choose(self) -> None:
        """The factor the budget asks for, from the rounds measured so far."""
        cost = self.estimate.cost()
        if self.budget_mbit is None or cost is None:
            return
        choice = choose_factor(cost, self.budget_mbit, self.book.requested, self.max_factor)
        if choice.factor != self.book.requested and choice.meets:  # unmet, the line below says it all
            logger.info(f"--max-upload-mbit {self.budget_mbit:g}: asking the swarm for rounds of {choice.factor} x "
                        f"--target-batch-size (averaging would send {choice.mbit:.3g} Mbit/s; it takes effect two "
                        f"epochs on)")
        self.book.request(choice.factor)
        if self._meets and not choice.meets:
            logger.warning(unmet_budget_line(self.budget_mbit, choice.mbit, self.max_factor))
        elif choice.meets and not self._meets:
            logger.info(f"--max-upload-mbit {self.budget_mbit:g} is met again ({choice.mbit:.3g} Mbit/s at rounds of "
                        f"{choice.factor} x --target-batch-size)")
        self._meets, self._needed_mbit = choice.meets, choice.mbit
