"""One swarm, one state: every peer publishes a digest of its state per epoch, and checks it against the others'.

What a digest covers is what peers that trained together must hold bit for bit (canonical replies,
averaging/adapter/runner.py, make that possible): for gradient averaging, everything a state download hands
over (parameters and optimizer statistics); for DiLoCo, the outer state (round-start parameters and outer
momentum: the inner model moves on its own between rounds).

The rules, the same on every peer:
- The swarm's state at an epoch is the digest most peers that published one for that epoch hold; on a tie
  (two peers that disagree, two halves of a healed partition), the one held by the smallest peer id.
  `reference()` decides it.
- A peer compares at its newest epoch once every peer it counts has published one, or SETTLE_SECONDS after
  it published its own. Holding another digest than the swarm's, it is apart: it downloads.
- A peer never downloads from a peer whose digest at its newest compared epoch is not the swarm's (the
  DonorFilter stage, averaging/pipeline/donors.py, tells the averager processes); unless it only lost a tie
  to this peer's state and a round has since left this peer apart (that state is gone).
- A downloaded state is applied only if its digest is the one its donor published for the state's epoch and,
  where other peers published for that epoch too, the swarm's. A donor whose state is not what it published
  lied about one or the other: its offence excludes it at once (averaging/pipeline/exclusion.py). A donor
  whose state is not the swarm's (an honest peer that drifted) is only refused for a while.

One peer id claimed by two signing keys is ambiguous: both records are ignored (a forger can make a peer's
digests unreadable, never make a wrong state acceptable).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Dict, FrozenSet, Iterable, List, Mapping, Optional

from dht.records import MAX_DIGEST_EPOCHS, RecordPublisher, StateDigests, read_live

logger = logging.getLogger(__name__)

CHECK_SECONDS = 1.0
SETTLE_SECONDS = 3.0
"""How long after publishing its own digest for an epoch a peer waits for the others' before it compares."""
REFUSED_DONOR_SECONDS = 60.0
"""How long a donor whose state was not the swarm's is refused (an honest peer that drifted resyncs meanwhile)."""
UNPUBLISHED_DONOR_SECONDS = 5.0
"""How long a donor whose state could not be checked (no digest published for it yet) is skipped: the next
attempt tries another donor, and this one again once its digest is out."""
PUBLISHED_WAIT_SECONDS = 5.0
"""How long a download waits for its donor's digest of that epoch to appear, or to become the one it served (the
donor publishes it as it enters the epoch, and again after a download at that epoch; the DHT takes a moment)."""
READ_TIMEOUT_SECONDS = 5.0

DIGEST_MISMATCH, NOT_MAJORITY, UNPUBLISHED = "digest_mismatch", "not_majority", "unpublished"
REJECTION_REASONS = (DIGEST_MISMATCH, NOT_MAJORITY, UNPUBLISHED)


def reference(digests_by_peer: Mapping[str, str]) -> Optional[str]:
    """The swarm's digest among these peers' (peer id -> digest): the one most hold; on a tie, the one the
    smallest peer id holds. None for no peers."""
    if not digests_by_peer:
        return None
    counts = Counter(digests_by_peer.values())
    most = max(counts.values())
    tied = {digest for digest, count in counts.items() if count == most}
    return digests_by_peer[min(peer for peer, digest in digests_by_peer.items() if digest in tied)]


def majority(digests_by_peer: Mapping[str, str]) -> Optional[str]:
    """The digest more than half of these peers hold, if any."""
    counts = Counter(digests_by_peer.values())
    digest, count = counts.most_common(1)[0] if counts else (None, 0)
    return digest if count * 2 > len(digests_by_peer) else None


def by_peer(records: Iterable[StateDigests]) -> Dict[str, Dict[int, str]]:
    """peer id -> epoch -> digest; a peer id that two records claim is left out (see the module's docstring)."""
    claims = Counter(record.peer_id for record in records)
    return {record.peer_id: {int(epoch): digest for epoch, digest in record.digests.items()}
            for record in records if claims[record.peer_id] == 1}


@dataclass(frozen=True)
class StateCheck:
    """This peer's state at `epoch` against the swarm's."""

    epoch: int
    agrees: bool
    peers: int
    """Peers whose digests for `epoch` were compared, this one included."""
    own: str
    reference: str
    others: FrozenSet[str]
    """The other peers (ids) whose digest at their newest compared epoch is not the swarm's."""


class DigestBook:
    """This peer's digests of its recent epochs, the swarm's as last read, and what follows from them.

    The training thread records digests and asks `apart`; the watch thread reads the swarm's records.
    """

    def __init__(self, peer_id: str, read_records: Callable[[], List[StateDigests]],
                 on_check: Callable[[StateCheck], None] = lambda check: None,
                 on_refused: Callable[[FrozenSet[str]], None] = lambda peers: None,
                 clock: Callable[[], float] = time.monotonic):
        self.peer_id, self.read_records, self.on_check, self.on_refused = peer_id, read_records, on_check, on_refused
        self.clock = clock
        self._lock = threading.Lock()
        self._own: Dict[int, str] = {}
        self._recorded_at: Dict[int, float] = {}
        self._swarm: Dict[str, Dict[int, str]] = {}
        self._last: Optional[StateCheck] = None
        self._apart_at: Optional[int] = None  # the epoch at which a comparison found this peer apart
        self._refused_until: Dict[str, float] = {}
        self._minority: FrozenSet[str] = frozenset()
        self._minority_by_tie: Optional[int] = None  # the epoch of the last comparison, if this peer won it by a tie
        self._left_behind_at: Optional[int] = None  # the last epoch at which a round left this peer apart

    # --- the training thread ------------------------------------------------------------------

    def record(self, epoch: int, digest: str, downloaded: bool = False) -> None:
        """This peer's state at `epoch`; `downloaded`: another peer's, which ends being apart until compared."""
        with self._lock:
            self._own[epoch] = digest
            self._recorded_at[epoch] = self.clock()
            for old in sorted(self._own)[:-MAX_DIGEST_EPOCHS]:
                del self._own[old], self._recorded_at[old]
            if downloaded:  # what this peer held before is not its state any more: nothing to compare
                self._apart_at = None
                for old in [old for old in self._own if old < epoch]:
                    del self._own[old], self._recorded_at[old]

    def apart(self) -> bool:
        """Whether this peer's state was found apart from the swarm's since it last downloaded (it should
        download). Epochs go on meanwhile: a state apart at one epoch stays apart at the next."""
        return self._apart_at is not None

    def compared_since(self, epoch: int) -> bool:
        """Whether this peer's state at `epoch` or later has been compared with the swarm's."""
        last = self._last
        return last is not None and last.epoch >= epoch

    def record_value(self) -> dict:
        with self._lock:
            return StateDigests(peer_id=self.peer_id,
                                digests={str(epoch): digest for epoch, digest in self._own.items()}).dict()

    # --- the watch thread --------------------------------------------------------------------

    def compared_with_all(self, expected_peers: int) -> bool:
        """Whether this peer's newest digest has been compared with every peer it counts: until it records another,
        a read of the swarm's digests can tell it nothing new (each read gathers every peer's signed record from
        several DHT nodes)."""
        last = self._last
        with self._lock:
            newest = max(self._own, default=None)
            own = self._own.get(newest)
        return (last is not None and last.epoch == newest and last.own == own
                and last.peers >= max(2, expected_peers))

    def check(self, expected_peers: int) -> Optional[StateCheck]:
        """Read the swarm's digests and compare at this peer's newest epoch that can be compared now."""
        self._swarm = by_peer(self.read_records())
        with self._lock:
            own = dict(self._own)
            recorded_at = dict(self._recorded_at)
        for epoch in sorted(own, reverse=True):
            at_epoch = self._at_epoch(epoch, own[epoch])
            settled = self.clock() - recorded_at[epoch] >= SETTLE_SECONDS
            if len(at_epoch) >= max(2, expected_peers) or (settled and len(at_epoch) >= 2):
                return self._decide(epoch, at_epoch)
        return None

    def _at_epoch(self, epoch: int, own_digest: str) -> Dict[str, str]:
        at_epoch = {peer: digests[epoch] for peer, digests in self._swarm.items()
                    if peer != self.peer_id and epoch in digests}
        at_epoch[self.peer_id] = own_digest
        return at_epoch

    def _decide(self, epoch: int, at_epoch: Dict[str, str]) -> StateCheck:
        swarm_digest = reference(at_epoch)
        others = frozenset(peer for peer, digest in at_epoch.items()
                           if peer != self.peer_id and digest != swarm_digest)
        own = at_epoch[self.peer_id]
        check = StateCheck(epoch, own == swarm_digest, len(at_epoch), own, swarm_digest, others)
        last, self._last = self._last, check
        with self._lock:
            if not check.agrees and self._own.get(epoch) == own:  # not replaced by a download meanwhile
                self._apart_at = epoch if self._apart_at is None else self._apart_at
            elif self._apart_at is not None and epoch >= self._apart_at:
                self._apart_at = None
        self._minority = others
        self._minority_by_tie = epoch if check.agrees and majority(at_epoch) is None else None
        self.on_refused(self.refused_donors())
        # said once per change, and once per epoch at which this peer is found apart
        if last is None or last.agrees != check.agrees or (not check.agrees and last.epoch != check.epoch):
            self.on_check(check)
        return check

    def state_left_behind(self, epoch: int) -> None:
        """A round left this peer apart at `epoch`: the peers it refused only for losing a tie of two to its state at
        that epoch or before (as the larger id) are donors again, that state being gone (seen: a peer whose last
        round failed refused the one peer that offered the final state, and left 6e-3 apart). Those a majority
        outvoted stay refused."""
        self._left_behind_at = epoch
        self.on_refused(self.refused_donors())

    def refused_donors(self) -> FrozenSet[str]:
        now = self.clock()
        recent = {peer for peer, until in self._refused_until.items() if until > now}
        tie, left_behind = self._minority_by_tie, self._left_behind_at
        won_by_a_state_now_gone = tie is not None and left_behind is not None and tie <= left_behind
        return frozenset(recent) | (frozenset() if won_by_a_state_now_gone else self._minority)

    # --- a download, on the training thread ---------------------------------------------------

    def judge_download(self, donor: Optional[str], epoch: int, digest: str,
                       sleep: Callable[[float], None] = time.sleep) -> Optional[str]:
        """Why a state downloaded from `donor` at `epoch` with `digest` must be refused, or None to accept it."""
        published = self._published(donor, epoch)
        if published != digest:  # the watch's last read may predate the donor's record (it reads only when needed)
            self._swarm = by_peer(self.read_records())
            published = self._published(donor, epoch)
        waited = 0.0
        # a donor that has just downloaded at this epoch serves a state its record shows a moment later: an honest
        # donor's record comes to show what it served, a liar's never does (CI: honest donors excluded without this)
        while published != digest and waited < PUBLISHED_WAIT_SECONDS:
            sleep(0.5)
            waited += 0.5
            self._swarm = by_peer(self.read_records())
            published = self._published(donor, epoch)
        if published is None:
            reason = UNPUBLISHED
        elif published != digest:
            reason = DIGEST_MISMATCH
        else:
            others = {peer: digests[epoch] for peer, digests in self._swarm.items()
                      if peer != donor and epoch in digests}
            others[donor] = published
            swarm_digest = majority(others) if len(others) > 2 else None
            reason = NOT_MAJORITY if swarm_digest is not None and swarm_digest != digest else None
        if reason is not None and donor is not None:
            seconds = UNPUBLISHED_DONOR_SECONDS if reason == UNPUBLISHED else REFUSED_DONOR_SECONDS
            self._refused_until[donor] = self.clock() + seconds
            self.on_refused(self.refused_donors())
        return reason

    def _published(self, donor: Optional[str], epoch: int) -> Optional[str]:
        return self._swarm.get(donor, {}).get(epoch) if donor is not None else None


class DigestWatch:
    """Publishes this peer's digests and checks them against the swarm's, in two threads, until closed."""

    def __init__(self, book: DigestBook, dht, key: str, expected_peers: Callable[[], int],
                 ttl_seconds: float, period_seconds: float = CHECK_SECONDS):
        self.book, self.expected_peers, self.period_seconds = book, expected_peers, period_seconds
        self.publisher = RecordPublisher(dht, key, book.record_value, period_seconds=max(period_seconds, 3.0),
                                         ttl_seconds=ttl_seconds)
        self._stop = threading.Event()
        self._checking = threading.Lock()  # the watch's checks and `check_now` never overlap
        self._thread = threading.Thread(target=self._run, name="digest-watch", daemon=True)

    def start(self) -> "DigestWatch":
        self.publisher.start()
        self._thread.start()
        return self

    def publish_now(self) -> None:
        """After a new digest: store it at once, off the training thread."""
        threading.Thread(target=self.publisher.publish_now, name="digest-publish", daemon=True).start()

    def check_now(self) -> None:
        """Compare again now, whatever the last comparison was: before a download, the peers that were apart then
        (refused as donors) may have downloaded the swarm's state since, and the peers that held it may have left."""
        with self._checking:
            self._check(force=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period_seconds):
            with self._checking:
                self._check(force=False)

    def _check(self, force: bool) -> None:
        try:
            expected_peers = self.expected_peers()
            if force or not self.book.compared_with_all(expected_peers):
                self.book.check(expected_peers)
        except Exception as e:  # a DHT read that failed: the next one may not
            logger.debug(f"could not check the swarm's state digests: {e!r}")

    def close(self, timeout_seconds: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_seconds)
        self.publisher.stop(timeout_seconds)


def records_reader(dht, key: str) -> Callable[[], List[StateDigests]]:
    return lambda: list(read_live(dht, key, StateDigests, READ_TIMEOUT_SECONDS).values())
