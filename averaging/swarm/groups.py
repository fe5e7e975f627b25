"""Which group of a grouped round this peer averages in (--target-group-size).

Every peer deals the peers of the round into groups by itself, from what it sees of the swarm: the peers in an order
drawn from the epoch the round leads to (the same on every peer), dealt in turn into N // K groups, so each group has
K to 2K - 1 members. The order changes with every epoch, so the groups mix across rounds: a peer averages with other
peers from round to round, and over rounds with the whole swarm (Moshpit SGD's mixing, without its grid). Peers that
see the same members deal the same groups; a peer that sees another swarm (one that joined or left a moment ago) may
land in a group by itself, whose round fails, and it then downloads a group's state.
"""
from __future__ import annotations

import hashlib
from typing import Iterable


def round_group(epoch: int, members: Iterable[bytes], me: bytes, group_size: int) -> int:
    """This peer's group (0 to N // group_size - 1) in the round that leads to `epoch`.

    :param members: the peer ids (bytes) of the peers in the round, as this peer sees them; this peer's own is added
    """
    def drawn(peer: bytes) -> bytes:
        return hashlib.sha256(epoch.to_bytes(8, "little", signed=True) + peer).digest()

    everyone = sorted(set(members) | {me}, key=drawn)
    return everyone.index(me) % max(1, len(everyone) // group_size)
