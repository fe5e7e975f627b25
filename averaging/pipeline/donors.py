"""The donor filter stage: the peers this peer must not download state from now (averaging/swarm/digests.py).

Those whose published state is not the swarm's, and those whose last download was refused. The training
process sets them; the averager process that downloads reads them (averaging/adapter/refusals.py), so hivemind
moves on to the next donor in its order.
"""
from __future__ import annotations

from typing import Iterable

from averaging.pipeline.peer_set import SharedPeerSet
from averaging.pipeline.round_pipeline import RoundStage


class DonorFilter(RoundStage):
    def __init__(self):
        self._refused = SharedPeerSet()

    def refuse(self, peers: Iterable[str]) -> None:
        """From now on, these base58 peer ids (and no others) are refused as donors."""
        self._refused.set(peers)

    def refuses_donor(self, peer_id) -> bool:
        return peer_id in self._refused.get()
