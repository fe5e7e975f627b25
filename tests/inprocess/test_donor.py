"""averaging/swarm/donor.py with real hivemind averagers: a peer that offers its state is the one others download,
and a peer apart from the swarm is the last one anybody downloads."""
from __future__ import annotations

import contextlib

import hivemind
import pytest
import torch

from averaging import adapter
from averaging.swarm.donor import (
    APART_PENALTY,
    DONOR_BONUS,
    declare_apart,
    declare_whole,
    declared_priorities,
    donor_view,
    final_offers,
    offer_priority,
    offer_state,
)
from tests.inprocess.test_averaging import start_dhts
from tests.peers import wait_until

EPOCH = 7


@contextlib.contextmanager
def donors(count: int):
    """`count` averagers at EPOCH, each holding its index as its state."""
    adapter.install()
    dhts, averagers = start_dhts(count), []
    try:
        for index, dht in enumerate(dhts):
            averager = hivemind.averaging.DecentralizedAverager(
                [torch.full((16,), float(index))], dht, prefix="donors", min_matchmaking_time=1.0, start=True)
            averager.state_sharing_priority = EPOCH
            averagers.append(averager)
        yield averagers
    finally:
        for averager in averagers:
            averager.shutdown()
        for dht in dhts:
            dht.shutdown()


@pytest.mark.timeout(120)
def test_a_downloading_peer_takes_the_offered_state_over_others_at_the_same_epoch():
    with donors(4) as averagers:
        # every peer holds a different state at the same epoch, as after a last round that failed
        downloader, offering, silent = averagers[0], averagers[2], averagers[3]
        silent.allow_state_sharing = False

        assert offer_state([offering, None], EPOCH)
        assert offering.state_sharing_priority == offer_priority(EPOCH, offering.peer_id.to_bytes())
        # hivemind breaks ties between equal priorities at random: five draws all landing on the offer is no luck
        for _ in range(5):
            _, tensors = downloader.load_state_from_peers(timeout=20)
            assert torch.equal(tensors[0], torch.full((16,), 2.0))
        assert not offer_state([silent], EPOCH)  # shares no state: it cannot tell others to download from it


@pytest.mark.timeout(120)
def test_two_offers_at_one_epoch_rank_by_peer_id_so_every_download_takes_the_smallest_ids():
    # grouped rounds: two peers that each saw no smaller id at the last epoch both offer, and their states differ
    with donors(3) as averagers:
        downloader, offering = averagers[0], averagers[1:]
        for averager in offering:
            assert offer_state([averager], EPOCH)
        first, second = sorted(offering, key=lambda averager: averager.peer_id.to_bytes())
        wait_until(lambda: len(final_offers(downloader, EPOCH)) == 2, timeout=15, message="both offers")
        offers = final_offers(downloader, EPOCH)
        assert max(offers, key=offers.get) == first.peer_id.to_bytes()
        assert all(EPOCH + DONOR_BONUS < priority < EPOCH + 1 for priority in offers.values())
        assert final_offers(downloader, EPOCH + 1) == {}  # offers are for their epoch only
        assert set(final_offers(downloader, EPOCH, excluded={first.peer_id.to_bytes()})) == {
            second.peer_id.to_bytes()}
        with first.get_tensors() as (expected,):
            expected = expected.clone()
        for _ in range(5):  # hivemind's random tie-break never comes into it
            _, tensors = downloader.load_state_from_peers(timeout=20)
            assert torch.equal(tensors[0], expected)


@pytest.mark.timeout(120)
def test_peers_apart_from_the_swarm_wait_for_a_whole_one_and_are_never_its_donors():
    with donors(3) as averagers:
        whole, apart, downloader = averagers
        declare_apart([apart, downloader, None], EPOCH)
        assert apart.state_sharing_priority == EPOCH - APART_PENALTY
        expected = {whole.peer_id.to_bytes(): EPOCH, apart.peer_id.to_bytes(): EPOCH - APART_PENALTY,
                    downloader.peer_id.to_bytes(): EPOCH - APART_PENALTY}
        wait_until(lambda: declared_priorities(whole) == expected, timeout=15, message="the three declarations")
        assert donor_view(apart, EPOCH).ahead and not donor_view(whole, EPOCH).ahead
        assert not donor_view(apart, EPOCH + 1).ahead
        for _ in range(5):  # the apart peer ranks below the whole one, whatever hivemind's tie-break draws
            _, tensors = downloader.load_state_from_peers(timeout=20)
            assert torch.equal(tensors[0], torch.full((16,), 0.0))

        declare_apart([whole], EPOCH)  # every round went wrong alike, as when a reducer died
        expected[whole.peer_id.to_bytes()] = EPOCH - APART_PENALTY
        wait_until(lambda: declared_priorities(whole) == expected, timeout=15, message="the new declaration")
        by_id = sorted(averagers, key=lambda averager: averager.peer_id.to_bytes())
        smallest = by_id[0]
        assert [donor_view(averager, EPOCH).smallest_apart for averager in by_id] == [True, False, False]
        # an excluded peer counts for nothing, neither as a donor nor as the reference
        assert donor_view(by_id[1], EPOCH, excluded={smallest.peer_id.to_bytes()}).smallest_apart

        declare_whole([smallest], EPOCH)  # the reference: every other apart peer now downloads its state
        wait_until(lambda: all(donor_view(averager, EPOCH).ahead for averager in by_id[1:]), timeout=15,
                   message="the reference's declaration")
        _, tensors = by_id[1].load_state_from_peers(timeout=20)
        with smallest.get_tensors() as (reference,):
            assert torch.equal(tensors[0], reference)
