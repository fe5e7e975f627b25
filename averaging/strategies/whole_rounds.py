"""Whole-swarm rounds begin once the swarm is in: each round is told how many peers to expect.

A round of sync (and powersgd) averages every peer's gradients, then every peer's parameters. hivemind closes a
round's group when its leader's matchmaking window ends (`--matchmaking-seconds`, 5 s by default), even when every
peer has long joined: on 2 peers of the tiny test model, whose epoch takes about a second of compute, that window
was most of every epoch.

So a round is told how many peers to expect: this peer and every other training peer whose progress record it has
read and that has not expired (a paused peer writes no training record). Its group closes as soon as that many
have joined (averaging/pipeline/expected_group.py), and otherwise when the window ends, as before. A peer counted
that does not come (it is behind, or it left and its record has not expired yet) costs the round its window, as
every round paid before. Counting only the peers whose last record was at the round's epoch was tried first: it
closed groups without a peer whose record was read late (on 4 peers, 11 of 29 rounds split).

A longer window was tried too, for the peers that learn late that the epoch has ended (16 peers on 2 cores reached
the same epoch's end 24 to 50 s apart): it made things worse. A group of the whole swarm then waited for its
slowest member to reach the epoch's end, and its rounds timed out (BENCHMARKS.md, swarm_size).
"""
from __future__ import annotations

from averaging.pipeline.expected_group import ExpectedGroup
from averaging.swarm.groups import RecentPeers


class WholeRounds:
    """One averager's whole-swarm rounds: `expect` tells each round how many peers it waits for."""

    def __init__(self, census: RecentPeers, me: bytes):
        """:param census: the training peers this peer's progress tracker has read; `me` is this peer's id"""
        self.census, self.me = census, me
        self.expected = ExpectedGroup()  # include it in the averager's pipeline as the averager is built

    def expect(self, gathered: object) -> None:
        """Before a round that gathers `gathered` (the epoch it leads to) looks for its group: tell the averager's
        process how many peers to expect."""
        if type(gathered) is int:
            self.expected.expect(gathered, len(self.census.current() | {self.me}))
