"""Grouped rounds deal the swarm into groups of about K that change every round (averaging/swarm/groups.py)."""
from __future__ import annotations

from collections import Counter
from itertools import combinations

from averaging.swarm.groups import round_group

PEERS = [f"peer-{index}".encode() for index in range(16)]


def groups_of(epoch: int, peers, size: int) -> dict:
    """Every peer's group as that peer deals it, all of them seeing the same peers."""
    return {peer: round_group(epoch, peers, peer, size) for peer in peers}


def test_sixteen_peers_in_groups_of_four_are_four_groups_of_four_that_every_peer_deals_alike():
    for epoch in range(5):
        dealt = groups_of(epoch, PEERS, 4)
        assert sorted(Counter(dealt.values()).values()) == [4, 4, 4, 4]


def test_the_groups_change_from_round_to_round_so_every_pair_meets():
    met = set()
    for epoch in range(40):
        dealt = groups_of(epoch, PEERS, 4)
        met |= {frozenset(pair) for pair in combinations(PEERS, 2) if dealt[pair[0]] == dealt[pair[1]]}
    assert len(met) == len(list(combinations(PEERS, 2)))
    assert groups_of(1, PEERS, 4) != groups_of(2, PEERS, 4)


def test_a_swarm_that_k_does_not_divide_has_groups_of_k_to_2k_minus_1_and_a_small_one_is_one_group():
    assert sorted(Counter(groups_of(7, PEERS[:5], 2).values()).values()) == [2, 3]
    assert set(groups_of(7, PEERS[:3], 2).values()) == {0}
    assert round_group(7, [], b"alone", 4) == 0


def test_a_peer_counts_itself_whether_or_not_its_own_record_was_read():
    me = PEERS[0]
    assert round_group(3, PEERS[1:], me, 4) == round_group(3, PEERS, me, 4)
