"""averaging/donor.py with real hivemind averagers: a peer that offers its state is the one others download,
and a peer apart from the swarm is the last one anybody downloads."""
from __future__ import annotations

import contextlib

import hivemind
import pytest
import torch

from averaging import hivemind_compat
from averaging.donor import APART_PENALTY, DONOR_BONUS, declare_apart, donor_ahead, offer_state
from tests.peers import wait_until

EPOCH = 7


@contextlib.contextmanager
def donors(count: int):
    """`count` averagers at EPOCH, each holding its index as its state."""
    hivemind_compat.install()
    first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    dhts, averagers = [first], []
    try:
        dhts += [hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                              initial_peers=[str(a) for a in first.get_visible_maddrs()]) for _ in range(count - 1)]
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
        assert offering.state_sharing_priority == EPOCH + DONOR_BONUS
        # hivemind breaks ties between equal priorities at random: five draws all landing on the offer is no luck
        for _ in range(5):
            _, tensors = downloader.load_state_from_peers(timeout=20)
            assert torch.equal(tensors[0], torch.full((16,), 2.0))
        assert not offer_state([silent], EPOCH)  # shares no state: it cannot tell others to download from it


@pytest.mark.timeout(120)
def test_peers_apart_from_the_swarm_wait_for_a_whole_one_and_are_never_its_donors():
    with donors(3) as averagers:
        whole, apart, downloader = averagers
        declare_apart([apart, downloader, None], EPOCH)
        assert apart.state_sharing_priority == EPOCH - APART_PENALTY
        wait_until(lambda: donor_ahead(apart, EPOCH), timeout=15, message="the whole peer's declaration")
        assert not donor_ahead(apart, EPOCH, excluded={whole.peer_id.to_bytes()})
        assert not donor_ahead(apart, EPOCH + 1)
        for _ in range(5):  # the apart peer ranks below the whole one, whatever hivemind's tie-break draws
            _, tensors = downloader.load_state_from_peers(timeout=20)
            assert torch.equal(tensors[0], torch.full((16,), 0.0))

        declare_apart([whole], EPOCH)  # every round went wrong alike: nobody to wait for
        wait_until(lambda: not donor_ahead(apart, EPOCH), timeout=15, message="the whole peer's new declaration")
