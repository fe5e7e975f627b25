"""dht/reconnect.py: the re-contact policy (backoff, remembering, split and rejoin), then real DHTs on 127.0.0.1
where one node's peer stops answering, is dropped by hivemind, and is learned again once it answers."""
from __future__ import annotations

import concurrent.futures
import signal
from functools import partial
from typing import List

import psutil
import pytest

from dht.config import DHTConfig
from dht.keys import SwarmKeys
from dht.node import shutdown_dht, start_dht, visible_maddrs
from dht.reconnect import Contacts, Departures, Reconnector, Survey, peer_id_of, survey
from dht.records import PeerInfo, record_validators, store_own
from tests.peers import wait_until

A, B, C = "QmPeerA", "QmPeerB", "QmPeerC"


def test_peer_id_of_reads_the_p2p_part():
    assert peer_id_of("/ip4/1.2.3.4/tcp/31337/p2p/12D3KooWabc") == "12D3KooWabc"
    assert peer_id_of("/ip4/1.2.3.4/tcp/31337") is None


def test_a_silent_peer_is_retried_with_doubling_backoff_up_to_the_cap_and_reset_when_it_answers():
    contacts = Contacts([A], me="me", first_backoff_seconds=2, max_backoff_seconds=30, jitter=lambda: 1.0)
    assert contacts.due(0) == [A]  # an initial peer is contacted at once
    now, waits = 0.0, []
    for _ in range(7):
        contacts.update(now, table=[], answers={A: False})
        waits.append(contacts.contacts[A].next_try - now)
        now = contacts.contacts[A].next_try
        assert contacts.due(now - 0.01) == [] and contacts.due(now) == [A]
    assert waits == [2, 4, 8, 16, 30, 30, 30]
    contacts.update(now, table=[], answers={A: True})
    assert contacts.contacts[A].backoff == 2 and contacts.contacts[A].failures == 0
    # an answering peer is only checked once per cap
    assert contacts.due(now + 29) == [] and contacts.due(now + 30) == [A]


def test_a_peer_seen_in_the_routing_table_is_remembered_after_hivemind_drops_it():
    contacts = Contacts([], me="me", first_backoff_seconds=1, max_backoff_seconds=8, jitter=lambda: 1.0)
    contacts.update(0, table=[B, "me"], answers={})
    assert set(contacts.contacts) == {B}  # never itself
    assert contacts.due(1) == []
    contacts.update(1, table=[], answers={})  # dropped after a request it did not answer
    assert contacts.due(1) == [B]  # checked at once, not after the cap
    contacts.update(1, table=[], answers={B: False})
    assert B in contacts.contacts and contacts.due(1.5) == [] and contacts.due(2) == [B]


def test_split_is_reported_after_repeated_failures_and_rejoin_when_the_peers_answer():
    contacts = Contacts([A], me="me", first_backoff_seconds=1, max_backoff_seconds=4, lost_after_failures=2)
    contacts.update(0, table=[A, B, C], answers={A: True})
    assert contacts.settle().lost == [] and contacts.reachable_count == 4
    contacts.update(1, table=[A], answers={B: False, C: False})
    assert contacts.settle().lost == []  # one lost ping is no split
    contacts.update(2, table=[A], answers={B: False, C: False})
    change = contacts.settle()
    assert change.lost == [B, C] and change.returned == [] and contacts.reachable_count == 2
    assert contacts.settle().lost == []  # said once
    contacts.update(6, table=[A], answers={B: True, C: False})
    change = contacts.settle()
    assert change.returned == [B] and contacts.lost == {C}
    contacts.update(10, table=[A, B, C], answers={})  # C came back through hivemind's own traffic
    assert contacts.settle().returned == [C] and contacts.reachable_count == 4


def test_retries_are_spread_by_jitter_within_the_backoff():
    draws = iter([0.5, 1.0, 0.75])
    contacts = Contacts([], me="me", first_backoff_seconds=4, max_backoff_seconds=30, jitter=lambda: next(draws))
    contacts.update(0, table=[A], answers={})
    waits = []
    for _ in range(3):
        start = contacts.contacts[A].next_try = 0.0
        contacts.update(start, table=[], answers={A: False})
        waits.append(contacts.contacts[A].next_try - start)
    assert waits == [2.0, 8.0, 12.0]  # 4 x 0.5, 8 x 1.0, 16 x 0.75


def test_once_one_silent_peer_answers_the_other_silent_peers_are_tried_at_once():
    contacts = Contacts([], me="me", first_backoff_seconds=2, max_backoff_seconds=30)
    contacts.update(0, table=[A, B], answers={})
    for now in (0, 2, 6, 14, 30):  # a long partition: both far into their backoff
        contacts.update(now, table=[], answers={A: False, B: False})
    assert contacts.due(31) == []
    contacts.update(31, table=[A], answers={})  # A came back (it pinged this node)
    assert contacts.due(31) == [B]


def test_peers_that_never_answered_are_not_reported_and_only_initial_peers_are_kept_forever():
    contacts = Contacts([A], me="me", first_backoff_seconds=1, max_backoff_seconds=4, forget_after_seconds=100)
    for now in range(0, 20, 4):
        contacts.update(now, table=[], answers={A: False})
    assert contacts.settle().lost == []  # an initial peer that never answered is not a split
    contacts.update(20, table=[B], answers={})
    contacts.update(21, table=[], answers={A: False, B: False})
    contacts.update(200, table=[], answers={A: False, B: False})
    assert set(contacts.contacts) == {A}


class FakeDHT:
    """run_coroutine answers with the next scripted survey; records what was due."""

    peer_id = "me"

    def __init__(self, surveys: List[Survey]):
        self.surveys, self.asked = list(surveys), []

    def run_coroutine(self, coroutine, return_future=False):
        self.asked.append(list(coroutine.args[0]))
        future = concurrent.futures.Future()
        future.set_result(self.surveys.pop(0))
        return future


def test_reconnector_reports_split_and_rejoin_and_forgets_peers_that_left():
    now = [0.0]
    splits, rejoins = [], []
    dht = FakeDHT([
        Survey(table=[B, C], answers={}),
        Survey(table=[], answers={B: False, C: False}),
        Survey(table=[], answers={B: False, C: False}),
        Survey(table=[B], answers={B: True}),
    ])
    reconnector = Reconnector(dht, [], on_split=lambda r, u: splits.append((r, u)), on_rejoined=rejoins.append,
                              departed=lambda: {C} if now[0] >= 1 else set(), clock=lambda: now[0],
                              first_backoff_seconds=1, max_backoff_seconds=4)
    for moment in (0, 1, 2, 4):
        now[0] = moment
        reconnector.tick()
    assert splits == [(1, [B])]  # C said it left: forgotten, not reported
    assert rejoins == [[B]] and reconnector.unreachable_peers() == set()
    assert set(reconnector.contacts.contacts) == {B}


# --- real DHT nodes on 127.0.0.1 ------------------------------------------------------------------------------

LOCAL = dict(host_maddrs=["/ip4/127.0.0.1/tcp/0"], startup_timeout_seconds=20.0)
KEYS = SwarmKeys.for_run("reconnect-test")


@pytest.fixture
def dhts():
    started = []

    def _start(**config):
        dht = start_dht(DHTConfig(**LOCAL, **config), record_validators=record_validators(KEYS))
        started.append(dht)
        return dht

    try:
        yield _start
    finally:
        for dht in reversed(started):
            for child in _p2pd(dht):
                child.send_signal(signal.SIGCONT)  # a paused daemon cannot stop
            shutdown_dht(dht)


def _p2pd(dht) -> List[psutil.Process]:
    try:
        return [child for child in psutil.Process(dht.pid).children(recursive=True) if "p2pd" in child.name()]
    except psutil.Error:
        return []


def routing_table(dht) -> List[str]:
    """The peers in the node's routing table, read by the reconnector's own survey (pinging nobody)."""
    return dht.run_coroutine(partial(survey, [], 1.0, 1.0)).table


@pytest.mark.timeout(120)
def test_a_node_relearns_a_peer_that_stopped_answering_once_it_answers_again(dhts):
    first = dhts()
    second = dhts(initial_peers=visible_maddrs(first)[-1:])
    splits: List[tuple] = []
    rejoins: List[List[str]] = []
    reconnector = Reconnector(first, [], on_split=lambda r, u: splits.append((r, u)), on_rejoined=rejoins.append,
                              period_seconds=0.2, first_backoff_seconds=0.5, max_backoff_seconds=1.0)
    reconnector.start()
    try:
        wait_until(lambda: str(second.peer_id) in routing_table(first), 30, message="the second node in the table")
        for daemon in _p2pd(second):
            daemon.send_signal(signal.SIGSTOP)  # it stops answering: hivemind drops it after a failed ping
        wait_until(lambda: splits, 60, message="a split to be reported")
        assert splits[0] == (1, [str(second.peer_id)])
        assert reconnector.unreachable_peers() == {str(second.peer_id)}
        assert str(second.peer_id) not in routing_table(first)
        for daemon in _p2pd(second):
            daemon.send_signal(signal.SIGCONT)
        wait_until(lambda: rejoins, 60, message="the peer to be re-contacted")
        assert rejoins[0] == [str(second.peer_id)]
        assert str(second.peer_id) in routing_table(first)
    finally:
        reconnector.stop()
    assert not reconnector.is_alive()


@pytest.mark.timeout(90)
def test_departures_names_peers_whose_info_was_withdrawn(dhts):
    dht = dhts()
    departures = Departures(dht, KEYS.run_id)
    info = PeerInfo(peer_id="QmLeaving", version="0", device="cpu", client_mode=False, samples_per_second=0.0,
                    global_epoch=0, uptime_seconds=0.0, time=0.0)
    # a later expiry each time: the DHT keeps, per subkey, the value that expires last (as the publisher's do)
    assert store_own(dht, KEYS.peers, info.dict(), ttl_seconds=8)
    assert departures() == set()  # live: learned, not departed
    assert store_own(dht, KEYS.peers, None, ttl_seconds=9)
    assert departures() == {"QmLeaving"}
    wait_until(lambda: departures() == {"QmLeaving"} and not dht.get(KEYS.peers, latest=True), 30,
               message="the empty record to expire")  # remembered after it expired
    assert store_own(dht, KEYS.peers, info.dict(), ttl_seconds=30)
    assert departures() == set()  # back

