"""The swarm's round factor (averaging/swarm/round_factor.py): every peer applies the same one at the same epoch,
from the records it read, whatever order it read them in."""
from __future__ import annotations

from typing import Dict, List, Optional

import pytest
from hivemind.utils import ValueWithExpiration, get_dht_time
from pydantic.v1 import ValidationError

from averaging.swarm.round_factor import LEAD_EPOCHS, RoundFactorBook
from dht.records import PeerInfo, RoundFactorRecord, read_live

MAX = 8


def record(peer: str, requested: int = 1, schedule: Optional[Dict[int, int]] = None) -> RoundFactorRecord:
    return RoundFactorRecord(peer_id=peer, requested=requested,
                             schedule={str(epoch): factor for epoch, factor in (schedule or {}).items()})


def published(book: RoundFactorBook) -> RoundFactorRecord:
    """What the others read of `book`: nothing while it asks for 1 and applies 1 ahead, which reads as 1s."""
    value = book.record_value()
    return RoundFactorRecord.parse_obj(value) if value is not None else record(book.peer_id)


class Swarm:
    """Books that read each other's records as published when each entered its last epoch."""

    def __init__(self, *peers: str):
        self.books = {peer: RoundFactorBook(peer, MAX) for peer in peers}

    def read(self, peer: str, excluded=frozenset()) -> None:
        self.books[peer].seen([published(book) for other, book in self.books.items() if other != peer], excluded)

    def epoch(self, epoch: int) -> Dict[str, int]:
        """Every peer reads the others' records (as its round begins), then enters `epoch`."""
        for peer in self.books:
            self.read(peer)
        return {peer: book.enter(epoch) for peer, book in self.books.items()}


def test_a_request_applies_two_epochs_on_for_every_peer_alike():
    swarm = Swarm("a", "b", "c")
    assert swarm.epoch(0) == dict(a=1, b=1, c=1)
    swarm.books["a"].request(3)  # made as a enters epoch 1, before the others read it
    factors = {}
    for epoch in range(1, 6):
        factors[epoch] = swarm.epoch(epoch)
    assert factors[1] == factors[2] == dict(a=1, b=1, c=1)
    assert factors[1 + LEAD_EPOCHS] == dict(a=3, b=3, c=3)
    assert factors[5] == dict(a=3, b=3, c=3)


def test_a_request_read_only_at_the_next_epoch_still_applies_at_the_same_epoch_everywhere():
    a, b = RoundFactorBook("a", MAX), RoundFactorBook("b", MAX)
    for book in (a, b):
        book.enter(0)
    a.request(2)
    assert a.enter(1) == 1
    b.seen([])  # b read before a's new record was stored
    assert b.enter(1) == 1
    b.seen([published(a)])
    a.seen([published(b)])
    assert (a.enter(2), b.enter(2)) == (1, 1)
    b.seen([published(a)])
    a.seen([published(b)])
    assert (a.enter(3), b.enter(3)) == (2, 2)


def test_the_highest_request_wins_and_is_clamped_to_the_longest_round():
    swarm = Swarm("a", "b")
    swarm.epoch(0)
    swarm.books["a"].request(2)
    swarm.books["b"].request(100)  # above --max-round-factor: counts as it
    swarm.epoch(1)
    swarm.epoch(2)
    assert swarm.epoch(3) == dict(a=MAX, b=MAX)
    book = RoundFactorBook("c", MAX)
    book.seen([record("hostile", requested=1000, schedule={5: 1000})])  # stored within the schema's bound
    assert book.enter(5) == MAX  # its schedule's entry
    assert book.enter(6) == 1 and book.enter(7) == MAX  # its request, two epochs after the first entry read


def test_a_lower_request_lowers_the_factor_two_epochs_on_and_a_departure_too():
    swarm = Swarm("a", "b")
    swarm.epoch(0)
    swarm.books["a"].request(4)
    assert [swarm.epoch(epoch)["b"] for epoch in (1, 2, 3, 4)] == [1, 1, 4, 4]
    swarm.books["a"].request(1)
    assert [swarm.epoch(epoch) for epoch in (5, 6, 7)] == [dict(a=4, b=4), dict(a=4, b=4), dict(a=1, b=1)]
    swarm.books["a"].request(4)
    swarm.epoch(8)
    swarm.epoch(9)
    assert swarm.epoch(10) == dict(a=4, b=4)
    del swarm.books["a"]  # a leaves as it enters epoch 11: its record is withdrawn
    # b's schedule already holds a's request at the next two epochs: the departure takes effect after them
    assert [swarm.epoch(epoch)["b"] for epoch in (11, 12, 13)] == [4, 4, 1]


def test_a_newcomer_takes_the_epochs_it_enters_from_the_others_schedules():
    swarm = Swarm("a", "b")
    swarm.epoch(0)
    swarm.books["a"].request(2)
    for epoch in (1, 2, 3):
        swarm.epoch(epoch)
    newcomer = RoundFactorBook("n", MAX)
    newcomer.seen([published(book) for book in swarm.books.values()])
    assert newcomer.enter(3) == 2  # downloaded the swarm's state at epoch 3
    assert published(newcomer).schedule == {"3": 2, "4": 2, "5": 2}


def test_excluded_peers_and_this_peers_own_old_record_do_not_count():
    book = RoundFactorBook("me", MAX)
    book.seen([record("excluded", requested=8, schedule={0: 8, 1: 8, 2: 8}),
               record("me", requested=8, schedule={0: 8}),  # an old record of its own (a restart): not another peer's
               record("honest", requested=2)], excluded={"excluded"})
    assert book.enter(0) == 1
    assert published(book).schedule == {"0": 1, "1": 1, "2": 2}


def test_a_stale_record_is_not_read(monkeypatch):
    """read_live leaves out expired entries: a peer that died without withdrawing its record stops counting."""
    now = get_dht_time()
    entries = {b"live": ValueWithExpiration(record("live", requested=2).dict(), now + 10),
               b"stale": ValueWithExpiration(record("stale", requested=8, schedule={0: 8}).dict(), now - 1),
               b"garbage": ValueWithExpiration({"peer_id": "x", "requested": 0, "schedule": {}}, now + 10)}

    class FakeDHT:
        def get(self, key, latest, return_future):
            class Done:
                def result(self, timeout):
                    return ValueWithExpiration(entries, now + 10)
            return Done()

    records: List[RoundFactorRecord] = list(read_live(FakeDHT(), "key", RoundFactorRecord, 1.0).values())
    assert [r.peer_id for r in records] == ["live"]
    book = RoundFactorBook("me", MAX)
    book.seen(records)
    assert [book.enter(epoch) for epoch in (0, 1, 2)] == [1, 1, 2]


def test_the_record_schema_bounds_what_a_peer_can_store():
    with pytest.raises(ValidationError):
        record("a", requested=0)
    with pytest.raises(ValidationError):
        record("a", schedule={epoch: 1 for epoch in range(9)})
    assert RoundFactorBook("a", MAX).record_value() is None  # asking for 1, it stores nothing


def test_a_peer_info_carries_the_budget_and_the_factors_and_old_records_stay_readable():
    old = dict(peer_id="QmOld", version="0.1", device="cpu", client_mode=False, samples_per_second=1.0,
               global_epoch=3, uptime_seconds=5.0, time=1.0)
    assert (PeerInfo.parse_obj(old).round_factor, PeerInfo.parse_obj(old).upload_budget_mbit) == (None, None)
    new = PeerInfo(**old, upload_budget_mbit=2.5, round_factor_requested=4, round_factor=2)
    assert PeerInfo.parse_obj(new.dict()) == new
    with pytest.raises(ValidationError):
        PeerInfo(**old, upload_budget_mbit=float("inf"))
