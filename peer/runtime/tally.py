"""Where the optimizer's reports go: the peer's summary, its observer, and the judge of averaged updates.

The optimizer calls the hooks this builds (averaging/api.py AveragingHooks) from the training thread and, for
the digest watch and the exclusion watch, from background threads.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional, TypeVar

from averaging.api import AveragingHooks, LoopOptimizer, RoundLength, RoundReport
from averaging.codecs.compression import bytes_moved
from averaging.pipeline.update_check import UpdateCheck, refused_peers_line
from monitoring import PhaseTimer
from peer.runtime.credit import CreditLedger
from peer.telemetry.reports import TrainingObserver
from peer.telemetry.summary import PeerSummary
from peer.testing.faults import FaultInjector

logger = logging.getLogger(__name__)
T = TypeVar("T")


class RoundTally:
    """Where the optimizer's reports go: the summary's counters and the observer."""

    def __init__(self, summary: PeerSummary, observer: TrainingObserver, payload_bytes: int,
                 update_check: Optional[UpdateCheck] = None, credit: Optional[CreditLedger] = None):
        self.summary, self.observer = summary, observer
        self.credit = credit or CreditLedger(lambda: 0.0, lambda: summary.averaging_sent_bytes)
        self.payload_bytes = payload_bytes  # after compression: one contribution and the replies to it
        self.update_check = update_check  # None: averaged updates are not judged
        self.last_outcome: Optional[str] = None
        self.state: Optional[str] = None  # "agrees" or "apart": the last comparison with the swarm's state
        self.round_length: Optional[RoundLength] = None  # DiLoCo's, as of the last epoch this peer entered

    def hooks(self, timer: PhaseTimer, faults: Optional[FaultInjector] = None) -> AveragingHooks:
        faults = faults or FaultInjector()
        return AveragingHooks(phase=timer.phase, round_finished=self.on_round,
                              state_loaded=_both(faults.state_loaded, self.on_state_loaded),
                              contribution_dropped=self.on_dropped_contribution, peer_excluded=self.on_exclusion,
                              before_round=faults.before_round, guards_gradients=faults.guards_gradients,
                              serve_state=faults.serve_state_hook(),
                              state_checked=_both(faults.state_checked, self.on_state_check),
                              download_rejected=self.on_download_rejected, reducing_changed=self.on_reducing_changed,
                              contribution_accepted=self.credit.observed, round_length=self.on_round_length)

    def on_round(self, report: RoundReport) -> None:
        self.last_outcome = report.outcome
        self.summary.averaging_rounds[report.outcome] = self.summary.averaging_rounds.get(report.outcome, 0) + 1
        if report.outcome in ("ok", "partial"):
            self.summary.largest_group = max(self.summary.largest_group, report.group_size)
        self.summary.averaging_sent_bytes += bytes_moved(self.payload_bytes, report.group_size, report.outcome)
        if report.left_out > 0:
            self.summary.late_contributions += 1
        if self.update_check is not None:
            self.update_check.round_finished(report)
        self.observer.on_round(report, self.payload_bytes)

    def on_round_length(self, length: RoundLength) -> None:
        self.round_length = length
        self.summary.upload_budget_mbit = length.budget_mbit
        self.summary.round_factor_requested, self.summary.round_factor = length.requested, length.factor
        self.observer.on_round_length(length)

    def on_reducing_changed(self, reduces: bool) -> None:
        if not reduces:
            self.summary.stood_aside += 1
        self.observer.on_reducing_changed(reduces)

    def on_state_loaded(self, epoch: int) -> None:
        if self.update_check is not None:
            self.update_check.state_loaded()
        self.summary.state_downloads += 1
        logger.info(f"downloaded the swarm's state: now at epoch {epoch}")
        self.observer.on_state_loaded(epoch)

    def epoch_ended(self, samples: int) -> None:
        """This peer's samples of the epoch just ended count as given if its round averaged them."""
        self.credit.epoch_ended(samples, self.last_outcome or "")
        self.summary.credit_samples = self.credit.samples

    def judge_update(self, epoch: int, held_out_loss: Optional[float], optimizer: LoopOptimizer) -> None:
        """After a global epoch: whether the averaged update it applied raised the held-out loss; after repeated
        harmful updates, refuse the peers of those rounds (averaging/pipeline/update_check.py)."""
        found = None if self.update_check is None else self.update_check.epoch_ended(epoch, held_out_loss)
        if found is None:
            return
        logger.warning(refused_peers_line(found))
        optimizer.refuse(found.peers)
        self.summary.refused_peers.extend(sorted(found.peers))
        self.observer.on_harmful_updates(found)

    # the three below are called from background threads (the digest watch, the exclusion watch)
    def on_state_check(self, check) -> None:
        self.state = "agrees" if check.agrees else "apart"
        if not check.agrees:
            self.summary.state_disagreements += 1
        self.observer.on_state_check(check)

    def on_download_rejected(self, donor: str, reason: str) -> None:
        self.summary.rejected_downloads += 1
        self.observer.on_download_rejected(donor, reason)

    def on_dropped_contribution(self, reason: str) -> None:
        self.summary.dropped_contributions += 1
        self.observer.on_dropped_contribution(reason)

    def on_exclusion(self, peer_id: str) -> None:
        self.summary.excluded_peers.append(peer_id)
        self.observer.on_exclusion(peer_id)


def _both(first: Callable[[T], None], then: Callable[[T], None]) -> Callable[[T], None]:
    def call(value: T) -> None:
        first(value)
        then(value)
    return call
