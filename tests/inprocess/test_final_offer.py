"""Leaving at the last epoch with grouped rounds (peer/runtime/session.py), with a real DHT in this process: a peer
that offered its state, or took another's, and then sees an offer ranked above it downloads that one before it
leaves; without grouped rounds the offers all hold the swarm's one state, and nobody looks. A peer whose digests
found it apart takes the swarm's state before anything else, or, found apart only after it offered its own, while it
stays."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Callable, List

import hivemind
import pytest

from dht.keys import SwarmKeys
from dht.records import read_by_owner
from peer.process.signals import StopRequest
from peer.runtime import session as session_module
from peer.runtime.session import SwarmSession

EPOCH = 6


class LeavingOptimizer:
    """What leaving asks of the optimizer; a better offer shows up once this peer has offered its own.

    outvoted_after_offer: the digests the others publish after this peer offered its state outvote it, which only a
    fresh comparison (state_apart_now) shows; downloading, it notes what this peer's leave record said then."""

    def __init__(self, grouped: bool, digest_apart: bool = False, outvoted_after_offer: bool = False,
                 failed_downloads: int = 0, stay_seconds: float = 1.0):
        self.averages_in_groups, self.digest_apart, self.calls = grouped, digest_apart, []
        self.outvoted_after_offer, self.outvoted, self.failed_downloads = outvoted_after_offer, False, failed_downloads
        self.deadlines = SimpleNamespace(matchmaking_seconds=stay_seconds, averaging_timeout_seconds=2.0)
        self.local_epoch, self.downloaded_at_epoch = EPOCH, None
        self.announced: Callable[[], str] = lambda: "unknown"
        self._better_offers = 1

    @property
    def apart(self) -> bool:
        return self.digest_apart

    def await_state_comparison(self, timeout_seconds: float, expected_peers=None) -> None:
        pass

    def state_apart_now(self) -> bool:
        self.digest_apart |= self.outvoted
        return self.digest_apart

    def download_swarm_state(self) -> bool:
        if not self.digest_apart:
            return False
        if self.failed_downloads:
            self.failed_downloads -= 1
            self.calls.append(f"no donor served the swarm's state ({self.announced()})")
            return False
        self.calls.append(f"download the swarm's state ({self.announced()})")
        self.digest_apart = self.outvoted = False  # it holds the swarm's state now
        return True

    def load_state_from_donor_ahead(self) -> bool:
        return False

    def offer_final_state(self) -> bool:
        self.calls.append("offer")
        self.outvoted |= self.outvoted_after_offer
        return True

    def better_final_offer(self) -> bool:
        return "offer" in self.calls and self._better_offers > 0

    def download_final_state(self) -> bool:
        self.calls.append("download")
        self._better_offers -= 1  # what it downloaded is now the best offer
        return True


def leave(grouped: bool, **apart) -> List[str]:
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    optimizer = LeavingOptimizer(grouped, **apart)
    keys = SwarmKeys.for_run("final_offer_test")
    session = SwarmSession(dht, keys, optimizer, StopRequest(), record_ttl_seconds=30.0)
    optimizer.announced = lambda: (read_by_owner(dht, keys.leaving).get(session.me) or {}).get("state", "no record")
    try:
        session.leave_at_last_epoch("ok")
        return optimizer.calls
    finally:
        session.close()
        dht.shutdown()


@pytest.mark.timeout(60)
def test_a_grouped_peer_that_sees_an_offer_above_its_own_downloads_it_once():
    # alone at the last epoch, it offers its own state (the smallest id it can see); then a better-ranked one shows
    assert leave(grouped=True) == ["offer", "download"]


@pytest.mark.timeout(60)
def test_without_groups_a_peer_whose_round_was_whole_only_offers():
    assert leave(grouped=False) == ["offer"]


@pytest.mark.timeout(60)
def test_a_peer_its_digests_found_apart_takes_the_swarms_state_at_once_then_offers_it():
    # it knows the state to take and who holds it: no wait for offers, and it holds the swarm's state once it has
    assert leave(grouped=False, digest_apart=True) == ["download the swarm's state (no record)", "offer"]


@pytest.mark.timeout(60)
def test_a_peer_outvoted_after_it_offered_says_it_downloads_and_takes_the_swarms_state_while_it_stays():
    """16 peers: a peer compared its last digest with the first peers to publish, offered its state, and was
    outvoted once the others had published and downloaded; nothing compared again, and it left with its own."""
    assert leave(grouped=False, outvoted_after_offer=True) == ["offer", "download the swarm's state (downloading)"]


@pytest.mark.timeout(60)
def test_a_peer_outvoted_while_it_stays_tries_again_after_a_download_that_failed(monkeypatch):
    monkeypatch.setattr(session_module, "RECHECK_SECONDS", 0.0)  # at the next poll, within its 3 s stay
    assert leave(grouped=False, outvoted_after_offer=True, failed_downloads=1, stay_seconds=3.0) == [
        "offer", "no donor served the swarm's state (downloading)", "download the swarm's state (downloading)"]
