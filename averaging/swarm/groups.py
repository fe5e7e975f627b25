"""Which group of a grouped round this peer averages in (--target-group-size).

Every peer deals the peers of the round into groups by itself, from what it sees of the swarm: the peers in an order
drawn from the epoch the round leads to (the same on every peer), dealt in turn into N // K groups, so each group has
K to 2K - 1 members. The order changes with every epoch, so the groups mix across rounds: a peer averages with other
peers from round to round, and over rounds with the whole swarm (Moshpit SGD's mixing, without its grid).

Peers that see the same members deal the same groups. What a peer sees is every training peer whose progress record
it has read and that has not expired (`RecentPeers`), not only those of its last read: under load, one read of the
DHT misses records (16 peers on one 2-core machine: each read showed 6 to 14 of them, so peers dealt different groups
and met in twos and threes). A peer that left counts until its record expires (three matchmaking windows, at least
15 s), and its group averages without it meanwhile. A peer that sees another swarm (one that joined a moment ago) may
still land in a group by itself, whose round fails, and it then downloads a group's state.
"""
from __future__ import annotations

import hashlib
import math
from typing import Dict, FrozenSet, Iterable, NamedTuple, Tuple


class DealtGroup(NamedTuple):
    index: int  # 0 to N // group_size - 1
    size: int  # how many peers were dealt into it, this one included


def round_group(epoch: int, members: Iterable[bytes], me: bytes, group_size: int) -> DealtGroup:
    """This peer's group in the round that leads to `epoch`, and how many peers were dealt into it.

    :param members: the peer ids (bytes) of the peers in the round, as this peer sees them; this peer's own is added
    """
    def drawn(peer: bytes) -> bytes:
        return hashlib.sha256(epoch.to_bytes(8, "little", signed=True) + peer).digest()

    everyone = sorted(set(members) | {me}, key=drawn)
    groups = max(1, len(everyone) // group_size)
    index = everyone.index(me) % groups
    return DealtGroup(index, len(everyone[index::groups]))


class RecentPeers:
    """The training peers whose progress records this peer has read and that have not expired yet.

    Written by the progress tracker's thread on each read, read by the rounds' threads: each read replaces the
    mapping whole."""

    def __init__(self):
        self._expires: Dict[bytes, float] = {}

    def read(self, records: Iterable[Tuple[bytes, float]], now: float) -> None:
        """Take the (peer id, expiration time) of the records just read; forget those expired by `now`."""
        expires = dict(self._expires)
        for peer, expiration in records:
            expires[peer] = max(expires.get(peer, -math.inf), expiration)
        self._expires = {peer: expiration for peer, expiration in expires.items() if expiration > now}

    def current(self) -> FrozenSet[bytes]:
        return frozenset(self._expires)
