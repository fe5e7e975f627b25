"""One swarm, one state: every peer publishes a digest of its state per epoch, and checks it against the others'.

What a digest covers is what peers that trained together must hold bit for bit (canonical replies,
averaging/adapter/runner.py, make that possible): for gradient averaging, everything a state download hands
over (parameters and optimizer statistics); for DiLoCo, the outer state (round-start parameters and outer
momentum: the inner model moves on its own between rounds).

The rules, the same on every peer:
- The swarm's state at an epoch is the digest most peers that published one for that epoch hold; on a tie
  (two peers that disagree, two halves of a healed partition), the one held by the smallest peer id among the
  peers that serve their state (a client-mode peer cannot: a tie its state won left the other peer apart with no
  donor, and the two states stayed two). `reference()` decides it.
- A peer compares at its newest epoch once every peer it counts has published one, or once more than half of
  them hold one digest (no digest still to come can outvote it), or at the latest PATIENCE_SECONDS after it
  published its own (a peer it counts may have left). Holding another digest than the swarm's, it is apart: it
  downloads. Not sooner: a peer that downloads counts as a vote for the state it took, so a comparison with the
  first few peers to publish moved peers to a state that the later ones then outvoted (16 peers on one machine,
  whose rounds had split into groups of 3 to 6: two final states).
- A peer never downloads from a peer whose digest at its newest compared epoch is not the swarm's (the
  DonorFilter stage, averaging/pipeline/donors.py, tells the averager processes); unless it only lost a tie
  to this peer's state and a round has since left this peer apart (that state is gone).
- A downloaded state is applied only if its digest is the one its donor published for the state's epoch (or one
  another peer published for it: the donor downloaded that state itself and serves it before its own record shows
  it; 16 peers on one machine excluded two honest donors for this) and, where other peers published for that epoch
  too, the swarm's. A donor whose state is a state nobody published lied about one or the other: its offence
  excludes it at once (averaging/pipeline/exclusion.py); unless it had published nothing for that epoch when the
  state came (a peer apart publishes no digest, serves what it holds, and may then download and publish the state
  it took): that is only unpublished. A donor whose state is not the swarm's (an honest peer that drifted) is only
  refused for a while.

One peer id claimed by two signing keys is ambiguous: both records are ignored (a forger can make a peer's
digests unreadable, never make a wrong state acceptable).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import AbstractSet, Callable, Dict, FrozenSet, Iterable, List, Mapping, Optional, Set

from dht.records import MAX_DIGEST_EPOCHS, RecordPublisher, StateDigests, read_live

logger = logging.getLogger(__name__)

CHECK_SECONDS = 1.0
SETTLE_SECONDS = 3.0
"""How long a digest takes to be published and read by the others: the margin a leaving peer gives the last digests
of its last epoch (peer/runtime/session.py)."""
PATIENCE_SECONDS = 30.0
"""How long after publishing its own digest for an epoch a peer waits for the digests of every peer it counts,
while no digest holds more than half of them."""
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


def reference(digests_by_peer: Mapping[str, str], silent: AbstractSet[str] = frozenset()) -> Optional[str]:
    """The swarm's digest among these peers' (peer id -> digest): the one most hold; on a tie, the one the
    smallest peer id holds, of those not `silent` (serving no state) if any. None for no peers."""
    if not digests_by_peer:
        return None
    counts = Counter(digests_by_peer.values())
    most = max(counts.values())
    holders = [peer for peer, digest in digests_by_peer.items() if counts[digest] == most]
    return digests_by_peer[min([peer for peer in holders if peer not in silent] or holders)]


def majority(digests_by_peer: Mapping[str, str]) -> Optional[str]:
    """The digest more than half of these peers hold, if any."""
    counts = Counter(digests_by_peer.values())
    digest, count = counts.most_common(1)[0] if counts else (None, 0)
    return digest if count * 2 > len(digests_by_peer) else None


def decisive(digests_by_peer: Mapping[str, str], expected_peers: int) -> bool:
    """Whether one digest is held by more than half of the `expected_peers` (or of these peers, if more published):
    the swarm's state whatever the others still publish."""
    counts = Counter(digests_by_peer.values())
    return bool(counts) and 2 * max(counts.values()) > max(expected_peers, len(digests_by_peer))


def by_peer(records: Iterable[StateDigests]) -> Dict[str, Dict[int, str]]:
    """peer id -> epoch -> digest; a peer id that two records claim is left out (see the module's docstring)."""
    return {record.peer_id: {int(epoch): digest for epoch, digest in record.digests.items()}
            for record in _unambiguous(records)}


def silent_peers(records: Iterable[StateDigests]) -> FrozenSet[str]:
    """The peers whose records say that they serve no state."""
    return frozenset(record.peer_id for record in _unambiguous(records) if not record.serves)


def _unambiguous(records: Iterable[StateDigests]) -> List[StateDigests]:
    records = list(records)
    claims = Counter(record.peer_id for record in records)
    return [record for record in records if claims[record.peer_id] == 1]


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
        self.serves: Callable[[], bool] = lambda: True  # whether this peer serves its state (read as it publishes)
        self._lock = threading.Lock()
        self._own: Dict[int, str] = {}
        self._recorded_at: Dict[int, float] = {}
        self._swarm: Dict[str, Dict[int, str]] = {}
        self._silent: FrozenSet[str] = frozenset()  # the other peers that serve no state, as last read
        self._last: Optional[StateCheck] = None
        self._apart_at: Optional[int] = None  # the epoch at which a comparison found this peer apart
        self._refused_until: Dict[str, float] = {}
        self._unpublished: Set[str] = set()  # the donors in _refused_until only for want of a digest
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
            digests = {str(epoch): digest for epoch, digest in self._own.items()}
        return StateDigests(peer_id=self.peer_id, digests=digests, serves=self.serves()).dict()

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
        self._read_swarm()
        with self._lock:
            own = dict(self._own)
            recorded_at = dict(self._recorded_at)
        for epoch in sorted(own, reverse=True):
            at_epoch = self._at_epoch(epoch, own[epoch])
            waited_out = self.clock() - recorded_at[epoch] >= PATIENCE_SECONDS
            if len(at_epoch) >= 2 and (len(at_epoch) >= expected_peers or waited_out
                                       or decisive(at_epoch, expected_peers)):
                return self._decide(epoch, at_epoch)
        return None

    def _read_swarm(self) -> None:
        records = self.read_records()
        self._swarm, self._silent = by_peer(records), silent_peers(records) - {self.peer_id}

    def _at_epoch(self, epoch: int, own_digest: str) -> Dict[str, str]:
        at_epoch = {peer: digests[epoch] for peer, digests in self._swarm.items()
                    if peer != self.peer_id and epoch in digests}
        at_epoch[self.peer_id] = own_digest
        return at_epoch

    def _decide(self, epoch: int, at_epoch: Dict[str, str]) -> StateCheck:
        swarm_digest = reference(at_epoch, self._silent if self.serves() else self._silent | {self.peer_id})
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
            self._read_swarm()
            published = self._published(donor, epoch)
        # a donor apart from the swarm publishes no digest, and serves the state it holds; if it then downloads at
        # that epoch, the digest it publishes is the state it took, not the one it served: unpublished, no lie
        published_when_served = published is not None
        waited = 0.0
        # a donor that has just downloaded at this epoch serves a state its record shows a moment later: an honest
        # donor's record comes to show what it served, a liar's never does (CI: honest donors excluded without this)
        while published != digest and waited < PUBLISHED_WAIT_SECONDS:
            sleep(0.5)
            waited += 0.5
            self._read_swarm()
            published = self._published(donor, epoch)
        others = {peer: digests[epoch] for peer, digests in self._swarm.items() if peer != donor and epoch in digests}
        if published is None:
            reason = UNPUBLISHED
        elif published != digest and digest not in others.values():
            reason = DIGEST_MISMATCH if published_when_served else UNPUBLISHED
        else:
            others[donor] = published  # its vote is what it published, not the state it passes on
            swarm_digest = majority(others) if len(others) > 2 else None
            reason = NOT_MAJORITY if swarm_digest is not None and swarm_digest != digest else None
        if reason is not None and donor is not None:
            seconds = UNPUBLISHED_DONOR_SECONDS if reason == UNPUBLISHED else REFUSED_DONOR_SECONDS
            self._refused_until[donor] = self.clock() + seconds
            if reason == UNPUBLISHED:
                self._unpublished.add(donor)
            else:
                self._unpublished.discard(donor)
            self.on_refused(self.refused_donors())
        return reason

    def forgive_unpublished(self) -> None:
        """Take back the refusals of donors that had published no digest yet: a donor that offers its final state
        publishes its digest first (seen in CI: a peer refused its only partner as unpublished during a resync, then
        asked for that partner's final offer within the refusal, got nothing, and left apart 2e-2)."""
        for donor in self._unpublished:
            self._refused_until.pop(donor, None)
        self._unpublished.clear()
        self.on_refused(self.refused_donors())

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
