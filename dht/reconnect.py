"""Keep re-contacting the peers this node has known, with backoff, so that a partitioned swarm heals.

Why: hivemind's DHT drops a peer from its routing table on the first request that peer does not
answer (DHTProtocol.update_routing_table), and nothing ever dials it again: lookups only ask peers
still in the table, and a table refresh (off by default) asks the same peers. After a network
partition each half has dropped the other half, so when the link comes back the two halves never
meet again: two swarms, each training its own model (issue 30).

`Reconnector` remembers every peer it has seen (the initial peers, and each peer ever in the routing
table), also after hivemind dropped it. Every second it surveys the DHT process (`dht.run_coroutine`,
hivemind's public hook): it reads the routing table and pings the peers that are due. A peer that
stops answering is pinged again after `first_backoff_seconds`, doubling up to `max_backoff_seconds`
(each wait shortened at random by up to JITTER); one that answers has its backoff reset and is
re-checked every `max_backoff_seconds`. Once one silent peer answers again the network likely is
back, so the other silent peers are tried at once. A ping that gets through puts the peer back into
both routing tables (hivemind's ping does that on both sides), clears hivemind's blacklist entry for
it, and is followed by a lookup of this node's own id, through which the rest of the other half is
learned. From there hivemind's own traffic (progress records, matchmaking) spans the whole swarm again.

It also says when the swarm looks split: `on_split(reachable, unreachable)` once peers that answered
before have failed `LOST_AFTER_FAILURES` contacts in a row (reachable counts this node), and
`on_rejoined(peers)` when such peers answer again; `unreachable_peers()` names them meanwhile. A peer
that left on purpose looks the same from here, so the caller may pass `departed()`, the peers known to
have left: they are forgotten, not reported. A peer silent for `forget_after_seconds` is forgotten
too, unless it is an initial peer.

Limits: it pings by peer id, so it relies on p2pd still knowing the peer's addresses (libp2p keeps
those of recently connected peers for some minutes); it does not dial addresses itself, for hivemind
offers no public call for that. It must not block its caller: it runs in its own thread, and every
wait is bounded.
"""
from __future__ import annotations

import asyncio
import logging
import math
import random
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Collection, Dict, FrozenSet, Iterable, List, Optional, Set

from dht.keys import peers_key

logger = logging.getLogger(__name__)

FIRST_BACKOFF_SECONDS = 2.0
MAX_BACKOFF_SECONDS = 30.0
PERIOD_SECONDS = 1.0
"""How often the routing table is read; no peer is pinged more often than its backoff says."""
PING_TIMEOUT_SECONDS = 5.0
"""Bound on one ping (hivemind's own RPC timeout is 3 s)."""
LOOKUP_TIMEOUT_SECONDS = 10.0
JITTER = 0.5
"""A retry comes after (1 - JITTER) to 1 times the backoff: the peers of a half, cut off at the same moment, would
otherwise all retry at the same moments, and a heal would wait for that schedule rather than for the first of many."""
STOP_TIMEOUT_SECONDS = 3.0
LOST_AFTER_FAILURES = 2
"""Failed contacts in a row before a peer that answered before counts as unreachable: one lost ping is no split."""
FORGET_AFTER_SECONDS = 3600.0
"""A peer (other than an initial peer) silent this long is no longer re-contacted: a volunteer who left for good."""

SplitListener = Callable[[int, List[str]], None]
RejoinListener = Callable[[List[str]], None]


def peer_id_of(maddr: str) -> Optional[str]:
    """The peer id (base58) a multiaddr names after /p2p/, or None."""
    parts = str(maddr).split("/")
    return parts[parts.index("p2p") + 1] if "p2p" in parts[:-1] else None


@dataclass
class Contact:
    """What this node knows about reaching one peer."""

    initial: bool = False
    in_table: bool = False
    """In the routing table at the last survey."""
    reachable: bool = False
    """Answered (or sat in the routing table) at the last look."""
    ever_reachable: bool = False
    failures: int = 0
    """Failed contacts in a row."""
    backoff: float = FIRST_BACKOFF_SECONDS
    next_try: float = 0.0
    silent_since: Optional[float] = None


@dataclass
class Change:
    lost: List[str] = field(default_factory=list)
    """Peers that just became unreachable."""
    returned: List[str] = field(default_factory=list)
    """Unreachable peers that answered again."""


class Contacts:
    """The re-contact policy, apart from any DHT: who is due for a ping, and what a survey's answers mean.

    Times are the caller's monotonic clock, in seconds."""

    def __init__(self, initial: Iterable[str] = (), me: Optional[str] = None, *,
                 first_backoff_seconds: float = FIRST_BACKOFF_SECONDS, max_backoff_seconds: float = MAX_BACKOFF_SECONDS,
                 lost_after_failures: int = LOST_AFTER_FAILURES, forget_after_seconds: float = FORGET_AFTER_SECONDS,
                 jitter: Callable[[], float] = lambda: random.uniform(1 - JITTER, 1.0)):
        if not 0 < first_backoff_seconds <= max_backoff_seconds:
            raise ValueError(f"backoff must satisfy 0 < first ({first_backoff_seconds}) <= max ({max_backoff_seconds})")
        self.me = me
        self.first_backoff, self.max_backoff = first_backoff_seconds, max_backoff_seconds
        self.lost_after_failures, self.forget_after = lost_after_failures, forget_after_seconds
        self.jitter = jitter
        self.contacts: Dict[str, Contact] = {}
        self.lost: Set[str] = set()
        for peer in initial:
            if peer != me:
                self.contacts[peer] = Contact(initial=True, backoff=first_backoff_seconds)

    def due(self, now: float) -> List[str]:
        """Peers to ping now: silent ones whose backoff has passed, and answering ones due for a check."""
        return sorted(peer for peer, contact in self.contacts.items() if now >= contact.next_try)

    def update(self, now: float, table: Collection[str], answers: Dict[str, bool]) -> None:
        """Take in a survey: the peers in the routing table now, and the answers to the pings it sent."""
        table = set(table) - {self.me}
        silent = {peer for peer, contact in self.contacts.items() if contact.failures}
        for peer in table:
            contact = self.contacts.setdefault(peer, Contact(backoff=self.first_backoff))
            if peer not in answers and not contact.in_table:  # (re)learned by hivemind itself: it answered someone
                self._answered(contact, now)
            contact.in_table = True
        for peer, answered in answers.items():
            contact = self.contacts.get(peer)
            if contact is None:
                continue
            if answered:
                self._answered(contact, now)
            else:
                self._failed(contact, now)
        if any(self.contacts[peer].reachable for peer in silent if peer in self.contacts):
            # one silent peer is back: the network likely is, so the others are tried now, not at their backoff
            for peer in silent:
                if peer in self.contacts and not self.contacts[peer].reachable:
                    self.contacts[peer].next_try = min(self.contacts[peer].next_try, now)
        for peer, contact in self.contacts.items():
            if contact.in_table and peer not in table and peer not in answers:
                # hivemind dropped it after a request it did not answer: check at once rather than wait
                contact.in_table = False
                contact.next_try = now
        for peer in [peer for peer, contact in self.contacts.items()
                     if not contact.initial and contact.silent_since is not None
                     and now - contact.silent_since >= self.forget_after]:
            self.forget([peer])

    def _answered(self, contact: Contact, now: float) -> None:
        contact.reachable = contact.ever_reachable = True
        contact.failures, contact.backoff, contact.silent_since = 0, self.first_backoff, None
        contact.next_try = now + self.max_backoff  # a liveness check: hivemind may not talk to it that often

    def _failed(self, contact: Contact, now: float) -> None:
        contact.reachable, contact.in_table = False, False
        contact.failures += 1
        contact.next_try = now + contact.backoff * self.jitter()
        contact.backoff = min(2 * contact.backoff, self.max_backoff)
        if contact.silent_since is None:
            contact.silent_since = now

    def unreachable(self) -> Set[str]:
        """Peers that answered once and have now failed enough contacts in a row."""
        return {peer for peer, contact in self.contacts.items()
                if contact.ever_reachable and contact.failures >= self.lost_after_failures}

    def forget(self, peers: Iterable[str]) -> None:
        for peer in peers:
            self.contacts.pop(peer, None)
            self.lost.discard(peer)

    def settle(self) -> Change:
        """What changed since the last call: peers newly unreachable, and unreachable peers back."""
        now_lost = self.unreachable()
        change = Change(lost=sorted(now_lost - self.lost), returned=sorted(self.lost - now_lost))
        self.lost = now_lost
        return change

    @property
    def reachable_count(self) -> int:
        """Peers reachable now, this node included."""
        return 1 + sum(contact.reachable for contact in self.contacts.values())


@dataclass(frozen=True)
class Survey:
    table: List[str]
    answers: Dict[str, bool]


async def survey(due: List[str], ping_timeout_seconds: float, lookup_timeout_seconds: float, dht, node) -> Survey:
    """Runs inside the DHT process (DHT.run_coroutine): ping the `due` peers, then read the routing table.

    A peer that answers and was not in the table is back: this node then looks up its own id, which asks that
    peer for its neighbours (the rest of its half). Never raises: hivemind logs a coroutine's exception loudly."""
    from hivemind.p2p import PeerID

    protocol = node.protocol
    known = {str(peer_id) for peer_id in protocol.routing_table.peer_id_to_uid}

    async def ping(peer: str) -> bool:
        try:
            peer_id = PeerID.from_base58(peer)
            answered = await asyncio.wait_for(protocol.call_ping(peer_id), ping_timeout_seconds) is not None
            if answered:
                node.blacklist.register_success(peer_id)  # else lookups skip it for up to its ban time
            return answered
        except Exception as e:  # a malformed id, a timeout, a p2pd that is shutting down: it did not answer
            logger.debug(f"ping {peer}: {e!r}")
            return False

    answers = dict(zip(due, await asyncio.gather(*(ping(peer) for peer in due))))
    if any(answered and peer not in known for peer, answered in answers.items()):
        try:
            await asyncio.wait_for(node.find_nearest_nodes([node.node_id]), lookup_timeout_seconds)
        except Exception as e:
            logger.debug(f"lookup after a re-contact failed: {e!r}")
    await asyncio.sleep(0)  # hivemind updates the routing table in tasks the pings spawned
    return Survey(table=[str(peer_id) for peer_id in protocol.routing_table.peer_id_to_uid], answers=answers)


class Reconnector(threading.Thread):
    """Re-contacts known peers with backoff and reports splits; start() it, stop() it before the DHT shuts down.

    :param initial_peers: the multiaddrs the node started with (each must name its peer after /p2p/)
    :param departed: peers known to have left on purpose (called only when peers go silent)
    """

    def __init__(self, dht, initial_peers: Iterable[str] = (), *,
                 on_split: SplitListener = lambda reachable, unreachable: None,
                 on_rejoined: RejoinListener = lambda peers: None,
                 departed: Callable[[], Collection[str]] = frozenset,
                 period_seconds: float = PERIOD_SECONDS, ping_timeout_seconds: float = PING_TIMEOUT_SECONDS,
                 lookup_timeout_seconds: float = LOOKUP_TIMEOUT_SECONDS, clock: Callable[[], float] = time.monotonic,
                 **policy):
        super().__init__(name="Reconnector", daemon=True)
        self.dht = dht
        initial = [peer for peer in (peer_id_of(maddr) for maddr in initial_peers) if peer]
        self.contacts = Contacts(initial, str(dht.peer_id), **policy)
        self.on_split, self.on_rejoined, self.departed = on_split, on_rejoined, departed
        self.period, self.clock = period_seconds, clock
        self.ping_timeout, self.lookup_timeout = ping_timeout_seconds, lookup_timeout_seconds
        self._stop_event = threading.Event()
        self._departed_read_at = -math.inf
        self._unreachable: FrozenSet[str] = frozenset()  # read by other threads without the lock

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                self.tick()
            except Exception as e:  # a DHT going away: nothing to report, and the next tick may do better
                logger.debug(f"reconnector tick failed: {e!r}")
            self._stop_event.wait(self.period)

    def tick(self) -> Change:
        """One survey: ping the due peers, take in the routing table, report what changed (the thread's work; tests
        call it directly)."""
        due = self.contacts.due(self.clock())
        found: Survey = self.dht.run_coroutine(
            partial(survey, due, self.ping_timeout, self.lookup_timeout), return_future=True,
        ).result(timeout=self.survey_bound_seconds)
        if self._stop_event.is_set():  # the peer is leaving: no more DHT requests, and nothing to report after it
            return Change()
        now = self.clock()
        if found.answers:
            said = (f"{short(peer)} {'answered' if ok else 'silent'}" for peer, ok in found.answers.items())
            logger.debug(f"re-contact: {', '.join(said)}")
        self.contacts.update(now, found.table, found.answers)
        # asked now and then even with nobody silent: Departures learns whose record is whose while it is live
        if self.contacts.unreachable() - self.contacts.lost or now >= self._departed_read_at + self.max_backoff:
            self._departed_read_at = now
            self.contacts.forget(set(self._departed()) & set(self.contacts.contacts))
        change = self.contacts.settle()
        reachable, unreachable = self.contacts.reachable_count, sorted(self.contacts.lost)
        self._unreachable = frozenset(unreachable)
        if change.lost:
            logger.warning(f"the swarm looks split: {len(unreachable)} peer(s) this one reached before stopped "
                           f"answering ({', '.join(short(peer) for peer in unreachable)}), {reachable} reachable "
                           f"(this one included); re-contacting them with backoff "
                           f"(up to every {self.max_backoff:g}s)")
            self._report(self.on_split, reachable, unreachable)
        if change.returned:
            logger.info(f"peers that were unreachable answer again ({', '.join(map(short, change.returned))}): "
                        f"the swarm is joining up; {reachable} peer(s) reachable (this one included)")
            self._report(self.on_rejoined, change.returned)
        return change

    @property
    def max_backoff(self) -> float:
        return self.contacts.max_backoff

    @property
    def survey_bound_seconds(self) -> float:
        return self.ping_timeout + self.lookup_timeout + 5.0

    def _departed(self) -> Collection[str]:
        try:
            return self.departed()
        except Exception as e:  # not knowing who left is no reason to stop re-contacting
            logger.debug(f"could not read which peers left: {e!r}")
            return ()

    @staticmethod
    def _report(listener: Callable, *args) -> None:
        try:
            listener(*args)
        except Exception as e:  # a listener (the events file) must never stop the reconnector
            logger.debug(f"reconnector listener failed: {e!r}")

    def unreachable_peers(self) -> Set[str]:
        """The peers this node reached before and that stopped answering (those its last split report named, less
        those back since): e.g. donors not worth asking for a state while the swarm is split."""
        return set(self._unreachable)

    def stop(self, timeout_seconds: float = STOP_TIMEOUT_SECONDS) -> None:
        """Stop re-contacting. Waits for a survey in flight at most `timeout_seconds`: pings of silent peers may
        take their whole timeout, and a leaving peer has better things to do; the thread is a daemon, and its
        survey ends with the DHT."""
        self._stop_event.set()
        if self.is_alive():
            self.join(timeout_seconds)


def short(peer: str) -> str:
    """A peer id as `peer status` and the metrics show it: its last 8 characters."""
    return peer[-8:]


class Departures:
    """Peers that left on purpose: those whose PeerInfo record (dht/records.py) was withdrawn.

    A leaving peer's PeerInfoPublisher replaces its record with None, which names no peer, so the owner of each
    record is remembered while it is live, and a withdrawal is remembered after the empty record expired (until
    the owner publishes again). Call it now and then (Reconnector does) to learn them: best effort, a peer that
    joined and left between two calls is not known to have left."""

    def __init__(self, dht, run_id: str, timeout_seconds: float = 5.0):
        self.dht, self.key, self.timeout = dht, peers_key(run_id), timeout_seconds
        self.owners: Dict[bytes, str] = {}
        self.withdrawn: Set[bytes] = set()

    def __call__(self) -> Set[str]:
        found = self.dht.get(self.key, latest=True, return_future=True).result(timeout=self.timeout)
        entries = found.value.items() if found is not None and isinstance(found.value, dict) else []
        for owner, entry in entries:
            value = getattr(entry, "value", None)
            if value is None:
                self.withdrawn.add(owner)
            elif isinstance(value, dict) and isinstance(value.get("peer_id"), str):
                self.owners[owner] = value["peer_id"]
                self.withdrawn.discard(owner)
        return {self.owners[owner] for owner in self.withdrawn if owner in self.owners}
