"""The swarm's round factor: every DiLoCo peer applies the same one at the same epoch.

A round factor k makes an outer round (one global epoch) k x --target-batch-size samples long. Peers with an upload
budget ask for one (averaging/budget.py); the others ask for 1. Peers that trained an epoch together must apply one
outer update, so they must agree on where the epoch ends: a peer alone on a longer round would average with nobody.

Each peer publishes a RoundFactorRecord (dht/records.py): the factor it asks for, and its schedule, the factor it
will apply at each of its next epochs. The rules, the same on every peer:
- on entering epoch e, a peer sets its schedule at e, e+1 and e+2 to the highest of its own entry and every other
  live peer's entry there, and at e+2 (LEAD_EPOCHS ahead) also to the highest factor any live peer asks for;
  it applies its entry at e, clamped to [1, --max-round-factor];
- so a request made at epoch e takes effect at e+2: every peer has entered e+1 (and read the others' records
  since) before any of them applies it, and applies the same. A peer that leaves withdraws its record, but the
  others' schedules already hold what it asked for at the next two epochs: its departure, too, takes effect two
  epochs on, for all alike. A newcomer, or a peer back from a state download, takes the epochs it enters from
  the others' schedules.
- entries only rise by these merges, so the schedules converge to the highest; only the request at e+2 can lower
  the factor, two epochs ahead.
Records of excluded or refused peers do not count, and entries above --max-round-factor count as it: a hostile
peer can make rounds at most that long, which the run's manifest bounds. Peers see each other's records within
a round: each stores its record as it enters an epoch, reads theirs as each of its rounds begins (and every
READ_SECONDS), and merges what it read as it enters the next epoch. So an entry made on entering e is read at the
latest as the round that ends epoch e+1 begins, a whole round after it was stored. A record that takes longer than
that to reach another peer can make the two apply different factors for an epoch, as a failed round would; the
state digests then bring the peer apart back (averaging/swarm/digests.py).
"""
from __future__ import annotations

import logging
import threading
from typing import Callable, Collection, Dict, Iterable, List, Mapping, Optional

from dht.records import RecordPublisher, RoundFactorRecord, read_live

logger = logging.getLogger(__name__)

LEAD_EPOCHS = 2
"""A request made on entering epoch e applies from e + LEAD_EPOCHS on."""
READ_SECONDS = 10.0
"""A backstop: a peer reads the others' records as each of its rounds begins, and at least this often."""
READ_TIMEOUT_SECONDS = 5.0
PUBLISH_SECONDS = 5.0
"""A peer stores its record as it enters each epoch, and again this often to keep it alive (a third of the
shortest progress-record TTL, 15 s): what it costs a swarm's DHT beside the payload its rounds send."""


class RoundFactorBook:
    """This peer's request and schedule, and the other peers' records as last read.

    The training thread asks and enters epochs; the watch thread hands it what it read; the publisher reads
    `record_value`."""

    def __init__(self, peer_id: str, max_factor: int, lead_epochs: int = LEAD_EPOCHS):
        self.peer_id, self.max_factor, self.lead_epochs = peer_id, max_factor, lead_epochs
        self._lock = threading.Lock()
        self._requested = 1
        self._schedule: Dict[int, int] = {}
        self._others: List[RoundFactorRecord] = []
        self.read_once = False

    @property
    def requested(self) -> int:
        return self._requested

    def request(self, factor: int) -> None:
        """What this peer asks for from now on (it takes effect LEAD_EPOCHS after the next epoch it enters)."""
        with self._lock:
            self._requested = self._clamp(factor)

    def seen(self, records: Iterable[RoundFactorRecord], excluded: Collection[str] = frozenset()) -> None:
        """The other peers' live records, as just read (this peer's own, and excluded peers', are left out)."""
        others = [record for record in records if record.peer_id != self.peer_id and record.peer_id not in excluded]
        with self._lock:
            self._others, self.read_once = others, True

    def enter(self, epoch: int) -> int:
        """This peer enters `epoch`: merge the schedules, add the requests LEAD_EPOCHS ahead, and return the factor
        of `epoch`."""
        with self._lock:
            ahead = epoch + self.lead_epochs
            for at in range(epoch, ahead + 1):
                entries = [self._schedule.get(at, 1), *(_entry(record.schedule, at) for record in self._others)]
                if at == ahead:
                    entries += [self._requested, *(record.requested for record in self._others)]
                self._schedule[at] = self._clamp(max(entries))
            self._schedule = {at: factor for at, factor in self._schedule.items() if epoch <= at <= ahead}
            return self._schedule[epoch]

    def factor(self, epoch: int) -> int:
        """The factor this peer applies at `epoch` as things stand (1 before it entered any epoch)."""
        with self._lock:
            return self._schedule.get(epoch, 1)

    def record_value(self) -> Optional[dict]:
        """What this peer publishes; None while it asks for 1 and applies 1 at every epoch ahead (a missing record
        reads as that), so that a swarm without budgets stores nothing."""
        with self._lock:
            if self._requested == 1 and all(factor == 1 for factor in self._schedule.values()):
                return None
            return RoundFactorRecord(peer_id=self.peer_id, requested=self._requested,
                                     schedule={str(at): factor for at, factor in self._schedule.items()}).dict()

    def _clamp(self, factor: int) -> int:
        return min(self.max_factor, max(1, int(factor)))


def _entry(schedule: Mapping[str, int], epoch: int) -> int:
    return schedule.get(str(epoch), 1)


class RoundFactorWatch:
    """Publishes this peer's record and reads the others', in two threads, until closed."""

    def __init__(self, book: RoundFactorBook, dht, key: str, excluded: Callable[[], Collection[str]],
                 ttl_seconds: float, subkey: Optional[bytes] = None, period_seconds: float = READ_SECONDS):
        """:param subkey: the subkey this peer signs its record with (None: the process's, as its other records)"""
        self.book, self.dht, self.key, self.excluded = book, dht, key, excluded
        self.period_seconds = period_seconds
        self.publisher = RecordPublisher(dht, key, book.record_value, period_seconds=PUBLISH_SECONDS,
                                         ttl_seconds=ttl_seconds, subkey=subkey)
        self._stop, self._asked = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="round-factor-watch", daemon=True)

    def start(self) -> "RoundFactorWatch":
        self.publisher.start()
        self._thread.start()
        return self

    def publish_now(self) -> None:
        """After entering an epoch: store the new schedule at once, off the training thread."""
        threading.Thread(target=self.publisher.publish_now, name="round-factor-publish", daemon=True).start()

    def read_soon(self) -> None:
        """Read the others' records now, off the training thread."""
        self._asked.set()

    def read_now(self, timeout_seconds: float = READ_TIMEOUT_SECONDS) -> bool:
        """Read the others' records on this thread; False if the read failed (the last one read stands)."""
        try:
            self.book.seen(read_records(self.dht, self.key, timeout_seconds), self.excluded())
            return True
        except Exception as e:  # a DHT read that failed: the next one may not
            logger.debug(f"could not read the swarm's round factors: {e!r}")
            return False

    def _run(self) -> None:
        while not self._stop.is_set():
            self._asked.clear()
            self.read_now()
            self._asked.wait(self.period_seconds)

    def close(self, timeout_seconds: float = 5.0) -> None:
        self._stop.set()
        self._asked.set()
        if self._thread.is_alive():
            self._thread.join(timeout_seconds)
        self.publisher.stop(timeout_seconds)


def read_records(dht, key: str, timeout_seconds: float) -> List[RoundFactorRecord]:
    return list(read_live(dht, key, RoundFactorRecord, timeout_seconds).values())
