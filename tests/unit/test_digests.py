"""State digests (averaging/swarm/digests.py): the swarm's state, who is apart, and which downloads are refused."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Dict, List

import pytest
import torch

from averaging.pipeline.defence import Verdict
from averaging.pipeline.exclusion import BAD_STATE, ExclusionBook, ExclusionRule
from averaging.pipeline.state_digest import state_digest
from averaging.swarm import digests
from averaging.swarm.digests import (
    DIGEST_MISMATCH,
    NOT_MAJORITY,
    PATIENCE_SECONDS,
    UNPUBLISHED,
    DigestBook,
    by_peer,
    majority,
    reference,
)
from dht.records import StateDigests
from monitoring.metrics import REJECTION_REASONS

A, B, C, D = "12D3KooWA", "12D3KooWB", "12D3KooWC", "12D3KooWD"  # in this order, A is the smallest


def test_a_digest_sees_every_bit_and_the_layout_but_not_where_a_tensor_lives():
    tensor = torch.randn(100)
    same = tensor.clone()
    assert state_digest([tensor]) == state_digest([same])
    nudged = tensor.clone()
    nudged[17] = torch.nextafter(nudged[17], torch.tensor(float("inf")))  # one ulp
    assert state_digest([nudged]) != state_digest([tensor])
    assert state_digest([tensor.view(10, 10)]) != state_digest([tensor])
    assert state_digest([tensor[:50], tensor[50:]]) != state_digest([tensor[:40], tensor[40:]])
    assert state_digest([tensor.double()]) != state_digest([tensor])


def test_the_swarms_state_is_the_one_most_peers_hold_and_on_a_tie_the_smallest_peer_ids():
    assert reference({A: "x", B: "y", C: "y"}) == "y"
    assert reference({A: "x", B: "y"}) == "x"  # two peers that disagree: the smaller id's state wins
    assert reference({B: "y", A: "x", C: "z", D: "y"}) == "y"
    assert reference({B: "x", C: "x", A: "y", D: "y"}) == "y"  # a 2 + 2 split: the half holding A
    assert reference({}) is None
    # on a tie, a state that someone can download: a client-mode peer serves none
    assert reference({A: "x", B: "y"}, silent={A}) == "y"
    assert reference({A: "x", B: "y"}, silent={A, B}) == "x"
    assert reference({A: "x", B: "x", C: "y"}, silent={A, B}) == "x"  # a majority is a majority
    assert majority({A: "x", B: "y", C: "y"}) == "y"
    assert majority({A: "x", B: "y"}) is None
    assert majority({A: "x", B: "x", C: "y", D: "y"}) is None


def test_a_peer_id_claimed_by_two_records_is_ignored():
    records = [StateDigests(peer_id=A, digests={"3": "a" * 32}), StateDigests(peer_id=A, digests={"3": "b" * 32}),
               StateDigests(peer_id=B, digests={"3": "c" * 32, "4": "d" * 32})]
    assert by_peer(records) == {B: {3: "c" * 32, 4: "d" * 32}}


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def book_with(swarm: Dict[str, Dict[int, str]], me: str = A, clock=None, silent=()):
    """A DigestBook of peer `me`, reading `swarm` (peer -> epoch -> digest) as the DHT's records; the `silent` peers
    serve no state."""
    def read() -> List[StateDigests]:
        return [StateDigests(peer_id=peer, digests={str(epoch): digest for epoch, digest in own.items()},
                             serves=peer not in silent)
                for peer, own in swarm.items()]
    checks, refused = [], []
    book = DigestBook(me, read, on_check=checks.append, on_refused=refused.append, clock=clock or FakeClock())
    return book, checks, refused


X, Y, Z = "1" * 32, "2" * 32, "3" * 32


def test_a_peer_compares_once_every_peer_published_or_its_patience_ran_out():
    clock = FakeClock()
    swarm = {B: {5: Y}}
    book, checks, _ = book_with(swarm, clock=clock)
    book.record(5, X)
    assert book.check(expected_peers=3) is None  # C has not published yet, and may side with either
    clock.now += PATIENCE_SECONDS - 0.1
    assert book.check(expected_peers=3) is None
    clock.now += 0.1  # C may have left: compare with the peers there are
    check = book.check(expected_peers=3)
    assert check is not None and check.epoch == 5 and check.peers == 2
    assert check.agrees and check.reference == X  # a tie of two: A, the smaller id, holds the swarm's
    assert check.others == {B}
    swarm[C] = {5: Y}
    assert not book.check(expected_peers=3).agrees  # every peer has published: B and C outvote A


def test_a_peer_compares_at_once_when_more_than_half_of_the_swarm_holds_one_digest():
    """No digest still to come can outvote it; before, a peer that compared with the first few to publish could
    download a state that the later ones then outvoted (a download counts as a vote for the state it took)."""
    swarm = {B: {5: Y}, C: {5: Y}, D: {5: X}}
    book, _, _ = book_with(swarm)
    book.record(5, Z)
    assert book.check(expected_peers=7) is None  # Y: 2 of 7, and the three to come may all hold Z
    swarm.update({"12D3KooWE": {5: Y}, "12D3KooWF": {5: Y}})
    check = book.check(expected_peers=7)  # Y: 4 of 7
    assert check is not None and not check.agrees and check.reference == Y and check.peers == 6
    assert digests.decisive({A: X, B: Y, C: Y}, expected_peers=2)  # more peers published than were counted
    assert not digests.decisive({A: X, B: Y}, expected_peers=2)
    assert not digests.decisive({}, expected_peers=0)



def test_the_watch_reads_again_only_while_the_newest_digest_has_not_met_every_peer():
    clock = FakeClock()
    swarm = {B: {5: X}}
    book, _, _ = book_with(swarm, clock=clock)
    assert not book.compared_with_all(expected_peers=2)  # nothing recorded yet
    book.record(5, X)
    assert not book.compared_with_all(expected_peers=3)
    book.check(expected_peers=3)  # two of three agree, so A compares: C may still publish
    assert not book.compared_with_all(expected_peers=3)
    swarm[C] = {5: X}
    book.check(expected_peers=3)
    assert book.compared_with_all(expected_peers=3)  # nothing new until this peer records another digest
    assert not book.compared_with_all(expected_peers=4)  # or the swarm grows
    book.record(5, Y, downloaded=True)  # a state that replaced its own at the same epoch
    assert not book.compared_with_all(expected_peers=3)
    book.check(expected_peers=3)
    book.record(6, Y)
    assert not book.compared_with_all(expected_peers=3)

def test_a_peer_apart_from_the_majority_downloads_and_is_no_longer_apart_once_it_has():
    swarm = {B: {5: Y, 6: Y}, C: {5: Y}}
    book, checks, refused = book_with(swarm)
    book.record(5, X)
    check = book.check(expected_peers=3)
    assert not check.agrees and check.reference == Y and book.apart()
    assert checks[-1] is check
    book.record(6, Z)  # the next epoch goes on from the same wrong state: still apart
    assert book.apart()
    book.record(6, Y, downloaded=True)
    assert not book.apart()
    assert book.record_value()["digests"] == {"6": Y}  # what it held before the download is not compared again
    swarm[C][6] = Y
    assert book.check(expected_peers=3).agrees and not book.apart()


def test_before_a_download_the_refused_donors_are_those_apart_now_not_at_the_last_comparison():
    # 16 peers: an apart peer refused the peers apart with it, compared no more (it had met every peer), and once the
    # peers holding the swarm's state had left, found no donor it would take, though the others had repaired theirs
    swarm = {B: {8: Y}, C: {8: Y}, D: {8: Z}}
    book, _, refused = book_with(swarm)
    watch = digests.DigestWatch(book, dht=None, key="digests", expected_peers=lambda: 4, ttl_seconds=10.0)
    book.record(8, X)
    watch.check_now()
    assert book.apart() and book.refused_donors() == {D} and book.compared_with_all(expected_peers=4)
    swarm[D] = {8: Y}  # D downloaded the swarm's state
    watch.check_now()
    assert refused[-1] == frozenset() and book.apart()  # D is a donor again; this peer still has to download


def test_donors_whose_state_is_not_the_swarms_are_refused():
    swarm = {B: {5: Y}, C: {5: X}, D: {5: X}}
    book, _, refused = book_with(swarm)
    book.record(5, X)
    assert book.check(expected_peers=4).agrees
    assert refused[-1] == {B}
    assert book.refused_donors() == {B}


def test_a_peer_left_apart_by_a_round_takes_the_loser_of_its_tie_as_a_donor_again_not_a_majoritys():
    swarm = {B: {5: Y}}
    book, _, refused = book_with(swarm)
    book.record(5, X)
    assert book.check(expected_peers=2).agrees and book.refused_donors() == {B}  # a tie of two: A, the smaller id
    book.state_left_behind(6)  # its next round failed: the state that won the tie is gone, B's may be the one left
    assert refused[-1] == set() and book.refused_donors() == set()
    assert book.check(expected_peers=2).epoch == 5 and book.refused_donors() == set()  # compared again: the same
    swarm[B][7] = Y
    book.record(7, X, downloaded=True)  # its state at epoch 7 wins a new tie: B is refused again
    assert book.check(expected_peers=2).epoch == 7 and book.refused_donors() == {B}

    book, _, _ = book_with({B: {5: Y}, C: {5: X}})
    book.record(5, X)
    assert book.check(expected_peers=3).agrees
    book.state_left_behind(6)
    assert book.refused_donors() == {B}  # outvoted by a majority, whatever became of this peer's state


def test_a_tie_goes_to_the_state_of_a_peer_that_serves_it_not_to_a_client_mode_peers():
    # A, the smaller id, serves no state: had its state won, B would be apart with no donor, for good
    client, _, _ = book_with({B: {5: Y}})
    client.serves = lambda: False
    client.record(5, X)
    assert client.record_value()["serves"] is False
    check = client.check(expected_peers=2)
    assert not check.agrees and check.reference == Y and client.apart()

    server, _, refused = book_with({A: {5: X}}, me=B, silent={A})
    server.record(5, Y)
    assert server.check(expected_peers=2).agrees and refused[-1] == {A}

    server, _, _ = book_with({A: {5: X}}, me=B)  # where A serves its state, the smaller id's wins as before
    server.record(5, Y)
    assert not server.check(expected_peers=2).agrees


def test_a_download_from_a_donor_whose_record_shows_its_new_state_a_moment_later_is_accepted():
    # the donor downloaded at epoch 5 itself just before it served: its record still shows what it held before
    swarm = {A: {5: X}, B: {5: Y}, C: {5: Y}}
    book, _, refused = book_with(swarm, me=D)
    reads = []

    def republished(seconds: float) -> None:
        reads.append(seconds)
        if len(reads) == 3:
            swarm[A][5] = Y

    assert book.judge_download(A, 5, Y, sleep=republished) is None
    assert A not in book.refused_donors()


def judge(swarm, donor, epoch, digest):
    book, _, refused = book_with(swarm, me=D)
    return book.judge_download(donor, epoch, digest, sleep=lambda seconds: None), book


def test_a_download_is_accepted_only_if_it_is_what_its_donor_published_and_the_swarms():
    swarm = {A: {7: X}, B: {7: X}, C: {7: Y}}
    assert judge(swarm, A, 7, X)[0] is None
    reason, book = judge(swarm, A, 7, Z)  # a state nobody published: A lied about one or the other
    assert reason == DIGEST_MISMATCH and A in book.refused_donors()
    # C's state, which A took by download and serves before its record shows it, is no lie; A still votes for what
    # it published: X and Y tie two to two (no majority to refuse it), and against A and B's X, Y is refused
    assert judge({A: {7: X}, B: {7: Y}, C: {7: Y}, D: {7: X}}, A, 7, Y)[0] is None
    assert judge(swarm, B, 7, Y)[0] == NOT_MAJORITY
    assert judge(swarm, C, 7, Y)[0] == NOT_MAJORITY  # what C published, but not the swarm's
    assert judge(swarm, C, 8, Y)[0] == UNPUBLISHED  # nothing published for that epoch: cannot be checked
    assert judge(swarm, None, 7, X)[0] == UNPUBLISHED  # a state that names no donor
    assert judge({A: {7: X}, C: {7: Y}}, C, 7, Y)[0] is None  # no majority among two: the donor's word stands


def test_a_donor_apart_that_publishes_the_state_it_downloads_after_serving_its_own_is_not_taken_for_a_liar():
    # A was apart at epoch 9 (no digest), served the state it held, then downloaded the swarm's and published that
    swarm = {A: {8: X}, B: {9: Y}, C: {9: Y}}
    book, _, _ = book_with(swarm, me=D)
    reads = []

    def a_downloads_meanwhile(seconds: float) -> None:
        reads.append(seconds)
        swarm[A][9] = Y

    assert book.judge_download(A, 9, Z, sleep=a_downloads_meanwhile) == UNPUBLISHED  # refused a while, not excluded
    assert reads  # it waited for A's digest, which came, and was not the state A had served
    # the swarm's state, which it held as a copy before its record showed anything, is accepted whatever it publishes
    swarm = {A: {8: X}, B: {9: Y}, C: {9: Y}}
    book, _, _ = book_with(swarm, me=D)
    assert book.judge_download(A, 9, Y, sleep=lambda seconds: swarm[A].update({9: Z})) is None
    # a digest that was there when the state came, and is not that state, is a lie
    assert judge({A: {9: X}, B: {9: Y}, C: {9: Y}}, A, 9, Z)[0] == DIGEST_MISMATCH


def test_before_a_final_download_donors_refused_only_for_want_of_a_digest_are_asked_again():
    swarm = {A: {7: X}, B: {7: X}, C: {7: Y}}
    book, _, refused = book_with(swarm, me=D)
    no_wait = lambda seconds: None  # noqa: E731
    assert book.judge_download(A, 8, X, sleep=no_wait) == UNPUBLISHED  # A has no digest at epoch 8 yet
    assert book.judge_download(C, 7, Y, sleep=no_wait) == NOT_MAJORITY
    assert book.refused_donors() == {A, C}
    book.forgive_unpublished()
    assert book.refused_donors() == {C} and refused[-1] == {C}  # a donor whose state is not the swarm's stays refused


def test_every_rejection_reason_is_a_label_of_the_metric():
    assert set(digests.REJECTION_REASONS) == set(REJECTION_REASONS)


def test_a_donor_that_served_another_state_than_it_published_is_excluded_at_once():
    book = ExclusionBook(ExclusionRule(threshold=3, window=10))
    assert book.record([Verdict(B, "download-7", BAD_STATE, "it served another state")]) == [
        (B, "it served another state")]
    assert book.excluded == [B]
    assert book.record([Verdict(C, "r1", "norm"), Verdict(C, "r2", "norm")]) == []  # others keep their threshold


@pytest.mark.parametrize("epochs", [3, 40])
def test_a_record_keeps_the_newest_epochs_only(epochs):
    book, _, _ = book_with({})
    for epoch in range(epochs):
        book.record(epoch, X)
    kept = book.record_value()["digests"]
    assert len(kept) == min(epochs, 16) and str(epochs - 1) in kept


def test_a_leaving_peer_waits_only_for_the_digests_that_peers_may_still_publish(monkeypatch):
    from averaging.strategies import agreement as module

    clock, sleeps = FakeClock(), []

    counted_while_waiting = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        counted_while_waiting.append(agreement.watch.expected_peers())
        clock.now += seconds
    monkeypatch.setattr(module, "time", SimpleNamespace(monotonic=clock, sleep=sleep))
    dht = SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: A))
    agreement = module.StateAgreement(dht, "digests", hooks=None, defence=None, ttl_seconds=10.0)
    agreement.watch.expected_peers = lambda: 3  # the swarm's progress still counts three
    # the other two announced that they download (their last rounds failed): nothing to wait for
    assert not agreement.await_comparison(5, timeout_seconds=30.0, expected_peers=lambda: 1)
    assert sleeps == []
    # one of them may still publish: wait for it, up to the timeout
    assert not agreement.await_comparison(5, timeout_seconds=30.0, expected_peers=lambda: 2, poll_seconds=1.0)
    assert sum(sleeps) == 30.0
    # meanwhile the watch compared once those two had published, not all three; then it counts the swarm again
    assert set(counted_while_waiting) == {2} and agreement.watch.expected_peers() == 3
