"""The start gate (--min-peers, peer/runtime/session.py) with a real DHT in this process: a peer starts when
another peer says it saw the quorum, or when it sees another peer train, even if its own reads of the DHT never
show it all the peers."""
from __future__ import annotations

from types import SimpleNamespace

import hivemind
import pytest
from hivemind.utils import get_dht_time

from dht.keys import SwarmKeys
from dht.records import store_own
from peer.process.signals import StopRequest
from peer.runtime.session import SwarmSession, earliest_start, swarm_underway


def test_the_swarm_starts_at_the_earliest_start_any_peer_announced():
    assert earliest_start(None, []) is None
    assert earliest_start(None, [12.0, 10.5, "soon", None, True]) == 10.5  # malformed records are not times
    assert earliest_start(9.0, [12.0, 10.5]) == 9.0
    assert earliest_start(11.0, []) == 11.0


def test_the_swarm_is_underway_once_a_record_shows_samples_or_an_epoch():
    waiting = {b"a": {"epoch": 0, "samples_accumulated": 0}, b"b": {"epoch": 0, "samples_accumulated": 0}}
    assert not swarm_underway(waiting) and not swarm_underway({})
    assert swarm_underway({**waiting, b"c": {"epoch": 0, "samples_accumulated": 96}})
    assert swarm_underway({**waiting, b"c": {"epoch": 3, "samples_accumulated": 0}})
    assert not swarm_underway({**waiting, b"c": {"epoch": "3"}, b"d": "garbage", b"e": {"epoch": True}})


class WaitingOptimizer:
    """What the start gate asks of the optimizer: announce this peer, and a first read of the swarm."""

    def __init__(self):
        self.announced, self.deadlines = 0, SimpleNamespace(matchmaking_seconds=1.0)

    def announce(self) -> None:
        self.announced += 1

    def swarm_view(self, refresh_timeout_seconds: float = 0.0):
        return SimpleNamespace(peers=1, global_epoch=0)


@pytest.fixture
def gate():
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    keys = SwarmKeys.for_run("start_gate_test")
    session = SwarmSession(dht, keys, WaitingOptimizer(), StopRequest(), record_ttl_seconds=30.0)
    try:
        yield session, dht, keys
    finally:
        session.close()
        dht.shutdown()


@pytest.mark.timeout(60)
def test_a_peer_that_sees_too_few_peers_starts_when_another_announces_the_start(gate):
    session, dht, keys = gate
    # another peer saw the quorum a moment ago; this one sees no progress record at all
    assert store_own(dht, keys.start_gate, get_dht_time(), ttl_seconds=30.0)
    passed, seen = session.wait_for_quorum(min_peers=16, timeout_seconds=20.0)
    assert passed and seen < 16  # only the announced start can have passed it


@pytest.mark.timeout(60)
def test_a_peer_that_sees_too_few_peers_starts_when_it_sees_another_peer_train(gate):
    session, dht, keys = gate
    # the others passed the gate; this peer missed their start records, but reads a training peer's progress
    assert store_own(dht, keys.progress, {"epoch": 2, "samples_accumulated": 64}, ttl_seconds=30.0)
    passed, seen = session.wait_for_quorum(min_peers=16, timeout_seconds=20.0)
    assert passed and seen < 16


@pytest.mark.timeout(60)
def test_with_no_quorum_anywhere_the_gate_gives_up_at_its_timeout(gate):
    session, _, _ = gate
    passed, seen = session.wait_for_quorum(min_peers=16, timeout_seconds=2.0)
    assert not passed and seen < 16
    assert session.optimizer.announced >= 1  # it kept announcing itself while it waited
