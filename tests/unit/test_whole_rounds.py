"""Whole-swarm rounds (averaging/strategies/whole_rounds.py): how many peers a round expects."""
from __future__ import annotations

from averaging.strategies.whole_rounds import WholeRounds
from averaging.swarm.groups import RecentPeers

ME = b"me"


def whole_rounds(peers) -> WholeRounds:
    """`peers`: those whose progress records were read (expiring at 100), this peer's own among them or not."""
    census = RecentPeers()
    census.read([(peer, 100.0) for peer in peers], now=50.0)
    rounds = WholeRounds(census, ME)
    rounds.expected.prepare([])
    return rounds


def test_a_round_expects_every_training_peer_read_and_this_one():
    for read in ([ME, b"a", b"b", b"c"], [b"a", b"b", b"c"]):  # whether or not this peer's own record was read
        rounds = whole_rounds(read)
        rounds.expect(8)
        assert rounds.expected.of_round(8) == 4
        assert rounds.expected.of_round(7) is None  # told for the round to epoch 8 only


def test_a_peer_alone_or_a_round_that_gathers_no_epoch_expects_nobody():
    alone = whole_rounds([ME])
    alone.expect(4)
    assert alone.expected.of_round(4) is None  # upstream's group: whoever joins within the window
    rounds = whole_rounds([ME, b"a"])
    for gathered in (None, "4", True, {"epoch": 4}):
        rounds.expect(gathered)
    assert rounds.expected.of_round(4) is None
