"""What the strategies implement alike of the Protocols (averaging/api.py), written once.

Every strategy reads the swarm's progress from a hivemind ProgressTracker (`self.tracker`, its
record signed with `self.signing_key`); ReportsProgress turns that into the swarm view and the
announcement. The strategies that average (sync, diloco) also keep a RoundKeeper (`self.rounds`)
and a state averager that serves their state to others (`self.state_averager`); SharesState holds
what they do alike for the swarm session: apartness, donors, the final state, and what follows a
round. Each of them says which of its averagers declare it as a donor (`donor_averagers`) and how
it applies new deadlines (`_apply_deadlines`).

These classes must override no hivemind method: SyncOptimizer puts them before hivemind.Optimizer
in its bases, where averaging/adapter/ would not know them.
"""
from __future__ import annotations

import math
from typing import Callable, Iterable, Optional, Tuple

from hivemind.averaging import DecentralizedAverager
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.utils.crypto import RSAPrivateKey

from averaging.api import SwarmView
from averaging.deadlines import Deadlines
from averaging.pipeline import completeness
from averaging.pipeline.stragglers import claim
from averaging.strategies.agreement import StateAgreement
from averaging.strategies.rounds import RoundKeeper
from averaging.swarm import progress
from averaging.swarm.donor import (
    DonorView,
    declare_apart,
    declare_whole,
    donor_view,
    final_offers,
    offer_priority,
    offer_state,
)


class ReportsProgress:
    """The swarm view and the announcement, from `self.tracker` and `self.signing_key`."""

    tracker: ProgressTracker
    signing_key: RSAPrivateKey

    def swarm_view(self, refresh_timeout_seconds: Optional[float] = None) -> SwarmView:
        return progress.swarm_view(self.tracker, refresh_timeout_seconds)

    def announce(self) -> None:
        progress.announce(self.tracker, self.signing_key)

    def resume(self) -> None:
        progress.stand_active(self.tracker)

    def _others_present(self) -> bool:
        """Whether other peers count toward the swarm's progress: they may have averaged without this one."""
        return self.tracker.global_progress.num_peers > 1


class SharesState(ReportsProgress):
    """The session's side of a strategy that averages and serves its state from `self.state_averager`."""

    rounds: RoundKeeper
    averages_in_groups: bool = False
    averages_after_epoch: bool = False
    state_averager: TrainingStateAverager
    grad_averager: Optional[DecentralizedAverager]
    donor_averagers: Tuple
    """The averagers that declare this peer as a donor, and at which priority."""
    _apply_deadlines: Callable[[Deadlines], None]

    @property
    def scheduler(self):
        return self.state_averager.scheduler

    @property
    def apart(self) -> bool:
        return self.rounds.apart or (self.agreement is not None and self.agreement.apart())

    def _round_should_gather(self) -> Optional[int]:
        """How many peers each round should gather: every peer the swarm counts (None for grouped rounds)."""
        return None if self.averages_in_groups else self.tracker.global_progress.num_peers

    def await_state_comparison(self, timeout_seconds: float,
                               expected_peers: Optional[Callable[[], int]] = None) -> None:
        if self.agreement is not None and not self.rounds.apart:  # apart by its rounds, it downloads anyway
            self.agreement.await_comparison(self.local_epoch, timeout_seconds, expected_peers)

    def state_apart_now(self) -> bool:
        if self.agreement is None:
            return False
        self.agreement.refresh()
        return self.agreement.apart()

    def download_swarm_state(self) -> bool:
        return self.agreement is not None and self.agreement.apart() and self.load_state_from_peers()

    @property
    def downloaded_at_epoch(self) -> Optional[int]:
        return self.rounds.downloaded_at_epoch

    def load_state_from_donor_ahead(self) -> bool:
        return self._donors().ahead and self.load_state_from_peers()

    def refuse(self, peers: Iterable[str]) -> None:
        self.rounds.refuse(peers)

    _held_offer: float = -math.inf
    """The rank of the final-state offer this peer holds: its own, or the best one offered when it last downloaded
    (even if that download failed: a donor that has left is not asked again and again)."""

    def offer_final_state(self) -> bool:
        self.wait_for_background_updates()
        self._record_state(reference=True)
        offered = offer_state(self.donor_averagers, self.local_epoch)
        if offered:
            self._held_offer = offer_priority(self.local_epoch, self.state_averager.peer_id.to_bytes())
        return offered

    def download_final_state(self) -> bool:
        if self.agreement is not None:  # the offer it downloads was published with its digest
            self.agreement.forgive_unpublished()
        self._held_offer = max(self._held_offer, self._best_final_offer())
        return self.load_state_from_peers()  # hivemind takes the best-ranked donor first

    def better_final_offer(self) -> bool:
        return self._best_final_offer() > self._held_offer

    def _best_final_offer(self) -> float:
        offers = final_offers(self.state_averager, self.local_epoch, self.rounds.excluded_peer_ids())
        return max(offers.values(), default=-math.inf)

    def _donors(self) -> DonorView:
        return donor_view(self.state_averager, self.local_epoch, self.rounds.excluded_peer_ids())

    def _become_reference(self) -> None:
        self._record_state(reference=True)
        declare_whole(self.donor_averagers, self.local_epoch)

    def _resync_due(self) -> bool:
        """Whether to download now: a round left this peer apart, the swarm was ahead once its epoch settled, or
        its state is not the one the swarm holds."""
        return (self.rounds.take_resync(self._donors, self._become_reference)
                or self.rounds.behind_after_settling(self.local_epoch, self.swarm_view)
                or (self.agreement is not None and self.agreement.apart()))

    # --- state digests (averaging/strategies/agreement.py) ---------------------------------------

    agreement: Optional[StateAgreement] = None

    def _start_agreement(self, agreement: Optional[StateAgreement], select: slice) -> None:
        """Check the `select`ed tensors of what the state averager serves against the swarm's, every epoch."""
        self.agreement = agreement
        if agreement is not None:
            self.state_averager.check_download = agreement.check_download
            agreement.start(select, expected_peers=lambda: self.tracker.global_progress.num_peers,
                            serves=lambda: self.state_averager.allow_state_sharing)

    def _before_download_attempt(self) -> None:
        """Before each download attempt, two things.

        Store this peer's progress record: hivemind's tracker stops storing it once the swarm's epoch is two past
        the last one this peer accumulated samples in, so a peer that has fallen behind and spends its attempts
        downloading vanishes after the record's time to live, and peers leaving at --max-epochs, seeing nobody
        behind, leave without serving it (seen in CI: a peer whose round failed tried for 18 s, the other two left,
        and it ended with its own state, 3e-2 apart).

        Refuse as donors the peers apart from the swarm's state now, not those of the last comparison (16 peers:
        three apart ones refused every repaired peer, found the peers that held the swarm's state gone, and left
        with their own)."""
        self.announce()
        if self.agreement is not None:
            self.agreement.refresh()

    def _record_state(self, reference: bool = False) -> None:
        """The state of this epoch is final: digest and publish it. Not where its round left this peer apart: it
        knows its state is not the swarm's and downloads, and its digest must not count as a vote (two peers, one
        of whose last rounds failed, would tie, and the smaller id's state, maybe the failed one's, would win);
        unless its state is to be the `reference` all the same (every peer's round went wrong alike), which the
        others then download and check against this digest."""
        if self.agreement is None:
            return
        if reference or not self.rounds.apart:
            self.agreement.record(self.local_epoch, self.state_averager.served_digest(self.agreement.select))
        else:
            self.agreement.state_left_behind(self.local_epoch)

    def _close_agreement(self) -> None:
        if self.agreement is not None:
            self.agreement.close()

    def _after_round(self) -> None:
        """After a round: rank below the whole peers while apart, declare whether this peer reduces for its next
        groups, and choose the deadlines again ('auto')."""
        if self.rounds.apart:
            declare_apart(self.donor_averagers, self.local_epoch)
        declare_bandwidth((self.state_averager, self.grad_averager), self.rounds.role.bandwidth)
        retuned = self.rounds.retune(self.swarm_view())
        if retuned is not None:
            self._apply_deadlines(retuned)


def step_scheduler_to(scheduler, epoch: int) -> None:
    """Step an LR scheduler (or None) until it matches `epoch`, as hivemind's state averager does."""
    if scheduler is not None:
        while scheduler._step_count <= epoch:
            scheduler.step()


def declare_bandwidth(averagers: Iterable, bandwidth: Optional[float]) -> None:
    """What these averagers declare to their next groups as their bandwidth (0: reduce nothing; None: an equal
    share), with the reducers each found late in its last round: a claim (averaging/pipeline/stragglers.py) that
    hivemind gathers from every member as each round is scheduled."""
    for averager in averagers:
        if averager is not None:
            averager.bandwidth = claim(bandwidth, completeness.late_reducers(averager), averager.peer_id.to_base58())


def join_or_terminate(averagers: Iterable, timeout_seconds: float) -> None:
    """A bounded wait for each averager process that is still alive; one that hangs is terminated."""
    for averager in averagers:
        if averager is not None and averager.is_alive():
            averager.join(timeout_seconds)
            if averager.is_alive():
                averager.terminate()
