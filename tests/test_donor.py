"""averaging/donor.py with real hivemind averagers: a peer that offers its state is the one others download."""
from __future__ import annotations

import hivemind
import pytest
import torch

from averaging import hivemind_compat
from averaging.donor import DONOR_BONUS, offer_state

EPOCH = 7


@pytest.mark.timeout(120)
def test_a_downloading_peer_takes_the_offered_state_over_others_at_the_same_epoch():
    hivemind_compat.install()
    first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    dhts, averagers = [first], []
    try:
        dhts += [hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                              initial_peers=[str(a) for a in first.get_visible_maddrs()]) for _ in range(3)]
        for index, dht in enumerate(dhts):
            # every peer holds a different state at the same epoch, as after a last round that failed
            averager = hivemind.averaging.DecentralizedAverager(
                [torch.full((16,), float(index))], dht, prefix="donors", min_matchmaking_time=1.0, start=True)
            averager.state_sharing_priority = EPOCH
            averagers.append(averager)
        downloader, offering, silent = averagers[0], averagers[2], averagers[3]
        silent.allow_state_sharing = False

        assert offer_state([offering, None], EPOCH)
        assert offering.state_sharing_priority == EPOCH + DONOR_BONUS
        # hivemind breaks ties between equal priorities at random: five draws all landing on the offer is no luck
        for _ in range(5):
            _, tensors = downloader.load_state_from_peers(timeout=20)
            assert torch.equal(tensors[0], torch.full((16,), 2.0))
        assert not offer_state([silent], EPOCH)  # shares no state: it cannot tell others to download from it
    finally:
        for averager in averagers:
            averager.shutdown()
        for dht in dhts:
            dht.shutdown()
