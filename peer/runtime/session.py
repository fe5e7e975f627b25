"""This peer's membership in the swarm: joining (start gate, catching up) and leaving.

- The start gate (--min-peers): hivemind's tracker only counts peers that have accumulated
  samples, so peers that start together would each train alone for a while. Each waiting peer
  announces a zero-sample progress record, so every waiting peer is visible to the others before
  anyone steps; the gate reads these records itself, since with no samples anywhere the tracker
  refreshes only every 10 s. Peers notice the quorum at slightly different moments, and a first
  epoch can be shorter than that: each peer publishes when it saw the quorum, and all start
  START_SETTLE_SECONDS after the earliest of those times, including the peers whose own reads
  have not shown them the quorum yet; a peer that sees another one training starts at once.
- Catching up: before the first step, a peer behind the swarm downloads its state.
- Leaving at --max-epochs (the rules are in peer/runtime/leaving.py): a peer whose last round failed
  downloads the final state from a peer that has it; then it stays while another peer may still
  need it. With grouped rounds (--target-group-size), every peer leaves as if its last round had
  failed: the groups each hold a state of their own, so all take the one that the smallest id offers;
  where views differed and two peers offered, each peer that sees an offer ranked above the one it
  holds (averaging/swarm/donor.py) downloads that one, until it leaves.
- Leaving for any reason: rounds still looking for a group a matchmaking window (plus a second for
  the leader's answer) after leaving began never will find one, and are abandoned; without this,
  Ctrl+C on a peer whose partners just left waits each round out. So are the rounds of a peer left
  behind, once every other peer is at or past the epoch they lead to.

Every record lives in the run's training namespace (dht/keys.py), in this peer's own signed
subkey, for as long as progress records live.
"""
from __future__ import annotations

import logging
import math
import sys
import threading
import time
from typing import Callable, Dict, Iterable, Optional, Tuple

from hivemind.utils import get_dht_time

from averaging.api import APART, SessionOptimizer
from averaging.swarm.digests import CHECK_SECONDS, SETTLE_SECONDS
from averaging.swarm.open_rounds import RoundAbandoner
from dht.keys import SwarmKeys
from dht.records import own_subkey, read_by_owner, store_own
from peer.process.signals import StopRequest
from peer.runtime.leaving import (
    DONE,
    DOWNLOADING,
    PAUSED,
    Need,
    Source,
    everyone_else_done,
    everyone_else_leaving,
    final_state_source,
    has_final_state_elsewhere,
    has_peer_behind,
    leave_record,
    may_have_final_state,
    may_join_round_to,
    may_publish_digest,
    needs_of_others,
    seen_at_epoch,
)

logger = logging.getLogger(__name__)

START_SETTLE_SECONDS = 2.0
"""Peers that wait for each other start this long after the first of them saw the quorum: enough for
the others, polling every 0.25 s, to see it too."""
RECHECK_SECONDS = 3.0
"""How often a peer that stays at its last epoch compares its state with the swarm's again (a read of every peer's
digests), and downloads the swarm's state if it is apart."""
STATE_COMPARISON_SECONDS = SETTLE_SECONDS + 2 * CHECK_SECONDS
"""How long past its last round's deadline a peer leaving at its last epoch waits for that epoch's digests to be
compared with those of every peer that may still publish one: a peer one epoch behind publishes its digest once its
last round has ended."""


def earliest_start(own: Optional[float], announced: Iterable[object]) -> Optional[float]:
    """When the swarm starts: the earliest start any peer announced on seeing the quorum (this peer's `own`
    included); None while nobody has."""
    moments = [moment for moment in announced if isinstance(moment, (int, float)) and not isinstance(moment, bool)]
    return min(moments + ([own] if own is not None else []), default=None)


def swarm_underway(progress: Dict[bytes, object]) -> bool:
    """Whether some peer has begun training (it accumulated samples, or reached an epoch): peers at the start
    gate announce records with neither."""
    def counted(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value > 0

    return any(isinstance(record, dict) and (counted(record.get("epoch")) or counted(record.get("samples_accumulated")))
               for record in progress.values())


class SwarmSession:
    def __init__(
        self,
        dht,
        keys: SwarmKeys,
        optimizer: SessionOptimizer,
        stop: StopRequest,
        record_ttl_seconds: float,
        on_progress: Callable[[], None] = lambda: None,
    ):
        self.dht, self.keys, self.optimizer, self.stop = dht, keys, optimizer, stop
        self.record_ttl_seconds = record_ttl_seconds
        self.on_progress = on_progress  # heartbeat for /healthz: waiting for peers by design is not a stall
        self.me = own_subkey()
        self._leaving = threading.Event()
        self._records_read_at, self._records = -math.inf, None
        self._round_abandoner = RoundAbandoner(
            leaving=lambda: bool(stop) or self._leaving.is_set() or self._others_leaving_now(),
            grace_seconds=lambda: optimizer.deadlines.matchmaking_seconds + 1.0,
            nobody_joins=self._nobody_joins,
        )
        self._round_abandoner.start()

    # --- joining -----------------------------------------------------------------------------

    def wait_for_quorum(self, min_peers: int, timeout_seconds: float) -> Tuple[bool, int]:
        """Start gate: wait until min_peers peers are visible to this peer or to another one, then start together;
        whether the gate passed, and the most peers this peer saw."""
        deadline = time.monotonic() + timeout_seconds
        seen, start_at = 0, None
        while not self.stop and time.monotonic() < deadline:
            self.optimizer.announce()
            self.on_progress()
            progress = read_by_owner(self.dht, self.keys.progress)
            seen = max(seen, len(progress))
            if seen >= min_peers and start_at is None:
                start_at = get_dht_time()
                self._publish(self.keys.start_gate, start_at)
            if swarm_underway(progress) and start_at is None:  # it started without this peer: join it now
                start_at = get_dht_time() - START_SETTLE_SECONDS
            # a peer that saw the quorum says when: a read of the DHT may miss some peers' records for minutes
            # (16 peers on one machine: three saw all sixteen, the other thirteen never did and gave up; with
            # the announced start, two still saw neither it nor the quorum, but did see the others train)
            start_at = earliest_start(start_at, read_by_owner(self.dht, self.keys.start_gate).values())
            if start_at is not None and get_dht_time() >= start_at + START_SETTLE_SECONDS:
                self.optimizer.swarm_view(refresh_timeout_seconds=2.0)  # its first epoch counts the peers just seen
                return True, seen  # passed, even if a peer left meanwhile: swarms handle departures
            self.stop.wait(0.25)
        return False, seen

    def catch_up(self) -> None:
        """Before the first step: if the swarm is ahead of this peer, download its state."""
        global_epoch, local_epoch = self.optimizer.swarm_view().global_epoch, self.optimizer.local_epoch
        if global_epoch > local_epoch:
            logger.info(f"the swarm is at epoch {global_epoch}, this peer at {local_epoch}: "
                        f"downloading state from peers")
            self.optimizer.load_state_from_peers()

    # --- pausing -----------------------------------------------------------------------------

    def announce_paused(self) -> None:
        """Say (again: the record lives as long as progress records) that this peer is paused, so that peers
        leaving at their last epoch do not stay for it (peer/runtime/leaving.py)."""
        self._publish(self.keys.leaving, leave_record(self.optimizer.local_epoch, PAUSED))

    def announce_resumed(self) -> None:
        self._publish(self.keys.leaving, None)

    # --- leaving -----------------------------------------------------------------------------

    def begin_leaving(self) -> None:
        """From now on, rounds that find no group are abandoned (the loop has ended, or a stop came)."""
        self._leaving.set()

    def leave_at_last_epoch(self, last_round_outcome: Optional[str]) -> None:
        """End with the swarm's weights, and stay while a straggler may need ours.

        Stays one matchmaking window, then while peer.runtime.leaving says another peer needs this one, for
        at most three averaging timeouts: a peer that died behind must not keep it forever. Once every
        other peer has said it is done, nobody is left to serve: it leaves at once.
        """
        deadlines, epoch = self.optimizer.deadlines, self.optimizer.local_epoch
        matchmaking, timeout = deadlines.matchmaking_seconds, deadlines.averaging_timeout_seconds
        now = time.monotonic()
        stay_until, deadline = now + matchmaking, now + 3 * timeout + matchmaking
        # two groups of a split last round can each end it whole and still hold two states: the digests tell
        self.optimizer.await_state_comparison(matchmaking + timeout + STATE_COMPARISON_SECONDS,
                                              expected_peers=lambda: self._peers_to_compare_with(epoch))
        # each group of a grouped round ends it whole with a state of its own: every peer is apart, and the one with
        # the smallest id offers the final state; a donor "ahead" may be any group's, so none is taken
        grouped = self.optimizer.averages_in_groups
        # a peer its digests found apart knows which state is the swarm's: it takes it now, from a peer that holds
        # it, not after waiting for offers (16 peers: by then the peers that held it had left)
        repaired = not grouped and self.optimizer.download_swarm_state()
        progress = read_by_owner(self.dht, self.keys.progress)  # fresh: the tracker's view may lag
        # a state downloaded at the last epoch may predate its donor's last parameter round (hivemind averages
        # parameters in the background and applies the result a step later): take the state a peer offers once its
        # rounds have landed, as a peer whose last round failed does (seen: a straggler ended 5e-4 apart); not one
        # its digests showed to be the swarm's (repaired)
        copy = self.optimizer.downloaded_at_epoch == epoch
        apart = not repaired and (last_round_outcome in APART or self.optimizer.apart or copy or grouped)
        # peers that finished first may have stopped reporting progress, but they still offer their state; with a
        # straggler behind, an offer at this epoch may be this peer's own state, served to it: then ask as below
        if (apart and not grouped and not has_peer_behind(epoch, progress, self.me)
                and self.optimizer.load_state_from_donor_ahead()):
            apart = False
        if apart and may_have_final_state(epoch, progress, self.me):
            self._publish(self.keys.leaving, leave_record(epoch, DOWNLOADING, downloaded=copy))
            why = ("this peer's state came by download at this epoch" if copy else
                   "its rounds average groups of the swarm, not all of it" if grouped else
                   "the last averaging round failed")
            offers = self._take_final_state(epoch, matchmaking + timeout, candidate=not copy, why=why)
        else:
            offers = self.optimizer.offer_final_state()
        self._publish(self.keys.leaving, leave_record(epoch, DONE, offers))
        silent_since: Dict[bytes, float] = {}
        recheck_at = 0.0
        while not self.stop and time.monotonic() < deadline:
            if grouped and self.optimizer.better_final_offer():  # first: the others may all be done by now
                logger.info("a final state ranked above the one this peer holds is offered (a smaller peer id's): "
                            "downloading it, so that the swarm ends with one state")
                self.optimizer.download_final_state()
            if not grouped and time.monotonic() >= recheck_at:
                recheck_at = time.monotonic() + RECHECK_SECONDS
                self._take_swarm_state_if_outvoted(epoch, offers)
            progress, leaving = self._progress_and_leave_records()
            if everyone_else_done(progress, leaving, self.me):
                return
            needs = needs_of_others(epoch, progress, leaving, self.me)
            now = time.monotonic()
            for owner, need in needs.items():
                if need is Need.GRACE:
                    silent_since.setdefault(owner, now)
            waiting = now < stay_until or any(
                need is Need.SERVE or (need is Need.GRACE and now < silent_since[owner] + timeout + matchmaking)
                for owner, need in needs.items()
            )
            if not waiting:
                return
            self.stop.wait(0.5)

    def _take_swarm_state_if_outvoted(self, epoch: int, offers: bool) -> None:
        """While it stays: compare this peer's final state with the swarm's again, and take the swarm's if it is apart.

        The comparison before it settled counted the peers its records showed, which may lag, and the digests the
        others publish at the last epoch go on changing as they download; the swarm's state is the one most of them
        hold now. Seen at 16 peers: peers that settled on the first digests to arrive, or that compared with all
        sixteen before the others' downloads moved most of them to another state, left with their own: two final
        states, 10 and 6 peers. Downloading, it says so, so that the others stay to serve it."""
        if not self.optimizer.state_apart_now():
            return
        self._publish(self.keys.leaving, leave_record(epoch, DOWNLOADING, downloaded=True))
        if self.optimizer.download_swarm_state():
            logger.info("this peer's final state is not the one most peers hold now: it took the swarm's state")
        self._publish(self.keys.leaving, leave_record(epoch, DONE, offers))

    def _take_final_state(self, epoch: int, patience_seconds: float, candidate: bool, why: str) -> bool:
        """After a failed last round (`why`: what left this peer apart): download the state a peer offers, or offer
        ours if every peer at this epoch failed and ours has the smallest id. True if this peer offers its state.

        Waits up to `patience_seconds` for the others to say; then those silent at this epoch count as failed too,
        and it waits as long again for the smallest id's offer (or offers, if that is this peer); then those still
        silent are left out, and it waits as long again for the offer of the smallest id that said it downloads. A
        peer that is no candidate (peer.runtime.leaving.final_state_source) only waits for an offer."""
        for waits in range(3):
            source = self._final_state_source(epoch, time.monotonic() + patience_seconds, waits, candidate)
            if source is not Source.WAIT:
                break
        if source is Source.WAIT and not has_final_state_elsewhere(epoch, read_by_owner(self.dht, self.keys.progress),
                                                                   self.me):
            source = Source.OFFER  # nobody reached the last epoch in time: this peer's state is the newest there is
        if source is Source.OFFER:
            logger.info("no peer at the last epoch has a state that all the others share: "
                        "offering this peer's state as the final state, for the others to download")
            return self.optimizer.offer_final_state()
        # a donor offers its state, or none said in time: the best-ranked donor is the best guess
        logger.info(f"{why}: downloading the swarm's final state before leaving")
        self.optimizer.download_final_state()
        return False

    def _final_state_source(self, epoch: int, give_up_at: float, waits: int, candidate: bool) -> Source:
        """Read the swarm's records until they say where the final state comes from, or until `give_up_at`."""
        while True:
            records = self._progress_and_leave_records()
            source = final_state_source(epoch, *records, self.me, waits, candidate)
            if source is Source.WAIT and time.monotonic() >= give_up_at:
                logger.info(f"no final state to take yet at epoch {epoch}; the other peers there, or one epoch behind, "
                            f"as this peer reads them: {seen_at_epoch(epoch, *records, self.me)}")
            if source is not Source.WAIT or self.stop or time.monotonic() >= give_up_at:
                return source
            self.stop.wait(0.5)

    def close(self) -> None:
        """After the optimizer has shut down: stop watching its rounds."""
        self._leaving.set()
        self._round_abandoner.finish()

    def _others_leaving_now(self) -> bool:
        """Whether every other peer has announced that it leaves."""
        records = self._recent_records()
        return records is not None and everyone_else_leaving(*records, self.me)

    def _nobody_joins(self, epoch: int) -> bool:
        """Whether no other peer can join a round of this peer's that leads to `epoch` any more."""
        records = self._recent_records()
        return records is not None and not may_join_round_to(epoch, *records, self.me,
                                                             at_epoch=self.optimizer.averages_after_epoch)

    def _peers_to_compare_with(self, epoch: int) -> int:
        """This peer and the others that may still publish a state digest for `epoch`, its last (as many as the
        swarm counts, where the records could not be read)."""
        records = self._recent_records()
        return sys.maxsize if records is None else 1 + may_publish_digest(epoch, *records, self.me)

    def _recent_records(self) -> Optional[tuple]:
        """The progress and leave records, read from the DHT at most once a second; None if they could not be."""
        if time.monotonic() >= self._records_read_at + 1.0:
            self._records_read_at = time.monotonic()
            try:
                self._records = self._progress_and_leave_records()
            except Exception as e:  # a DHT that is shutting down: not knowing is no reason to drop a round
                logger.debug(f"could not read the other peers' records: {e!r}")
                self._records = None
        return self._records

    def _progress_and_leave_records(self) -> tuple:
        """Every peer's progress record and leave record, by owner, read from the DHT now."""
        return read_by_owner(self.dht, self.keys.progress), read_by_owner(self.dht, self.keys.leaving)

    def _publish(self, key: str, value) -> None:
        store_own(self.dht, key, value, self.record_ttl_seconds)
