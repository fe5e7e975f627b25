"""What a swarm test prints when a peer does not exit in time: where every peer was, not only the straggler's log."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from peer.process.launcher import PeerFailed
from peer.testing import harness


class _Peer(SimpleNamespace):
    """A peer as where_each_is and all_exited read it: a name, an epoch, a process and its exit code."""

    def _poll(self):
        return self.code

    async def exit_code(self, timeout: float) -> int:
        if self.code is None:
            raise PeerFailed(f"{self.name} still running after {timeout:.0f}s\n--- the end of its log ---")
        return self.code


def _peers():
    return [_Peer(name="peer-0", epoch=24, process=object(), code=0),
            _Peer(name="peer-1", epoch=21, process=object(), code=None),
            _Peer(name="peer-2", epoch=-1, process=None, code=None)]


def test_each_peer_is_named_with_its_epoch_and_whether_it_exited():
    assert harness.where_each_is(_peers()) == (
        "peer-0 at epoch 24, exited 0; peer-1 at epoch 21, running; peer-2 at epoch -1, not started")


def test_a_peer_that_does_not_exit_fails_the_wait_with_every_peers_place_and_its_own_log():
    swarm = harness.Swarm.__new__(harness.Swarm)  # all_exited reads only the peers it is given
    with pytest.raises(PeerFailed) as failed:
        asyncio.run(swarm.all_exited(timeout=0.0, peers=_peers()[:2]))
    first, second = str(failed.value).splitlines()[:2]
    assert first.startswith("peer-0 at epoch 24, exited 0; peer-1 at epoch 21, running")
    assert second == "peer-1 still running after 0s"
