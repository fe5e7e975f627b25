"""Grouped rounds deal the swarm into groups of about K that change every round (averaging/swarm/groups.py), and
end with the state the best-ranked offer holds (averaging/swarm/donor.py)."""
from __future__ import annotations

from collections import Counter
from itertools import combinations

from hivemind.utils import ValueWithExpiration

from averaging.adapter.progress_filter import training_records
from averaging.swarm.donor import DONOR_BONUS, OFFER_SPREAD, offer_priority
from averaging.swarm.groups import RecentPeers, round_group

PEERS = [f"peer-{index}".encode() for index in range(16)]


def groups_of(epoch: int, peers, size: int) -> dict:
    """Every peer's group as that peer deals it, all of them seeing the same peers."""
    return {peer: round_group(epoch, peers, peer, size) for peer in peers}


def sizes(dealt: dict) -> list:
    """The groups' sizes as counted, after checking that each member was told its group's size."""
    counted = Counter(group.index for group in dealt.values())
    assert all(group.size == counted[group.index] for group in dealt.values()), dealt
    return sorted(counted.values())


def test_sixteen_peers_in_groups_of_four_are_four_groups_of_four_that_every_peer_deals_alike():
    for epoch in range(5):
        assert sizes(groups_of(epoch, PEERS, 4)) == [4, 4, 4, 4]


def test_the_groups_change_from_round_to_round_so_every_pair_meets():
    met = set()
    for epoch in range(40):
        dealt = groups_of(epoch, PEERS, 4)
        met |= {frozenset(pair) for pair in combinations(PEERS, 2) if dealt[pair[0]] == dealt[pair[1]]}
    assert len(met) == len(list(combinations(PEERS, 2)))
    assert groups_of(1, PEERS, 4) != groups_of(2, PEERS, 4)


def test_a_swarm_that_k_does_not_divide_has_groups_of_k_to_2k_minus_1_and_a_small_one_is_one_group():
    for epoch in range(5):
        assert sizes(groups_of(epoch, PEERS[:5], 2)) == [2, 3]
        assert sizes(groups_of(epoch, PEERS[:7], 3)) == [3, 4]
    assert set(groups_of(7, PEERS[:3], 2).values()) == {(0, 3)}
    assert round_group(7, [], b"alone", 4) == (0, 1)


def test_a_peer_counts_itself_whether_or_not_its_own_record_was_read():
    me = PEERS[0]
    assert round_group(3, PEERS[1:], me, 4) == round_group(3, PEERS, me, 4)


def test_peers_read_once_count_until_their_record_expires_so_reads_that_miss_some_deal_the_same_groups():
    seen = RecentPeers()
    # two reads under load, each missing some records (a read showed 6 to 14 of 16 peers): together, all sixteen
    seen.read([(peer, 100.0) for peer in PEERS[:10]], now=50.0)
    seen.read([(peer, 110.0) for peer in PEERS[6:]], now=60.0)
    assert seen.current() == frozenset(PEERS)
    assert {peer: round_group(4, seen.current(), peer, 4) for peer in PEERS} == groups_of(4, PEERS, 4)

    seen.read([(PEERS[0], 130.0)], now=105.0)  # the others of the first read only have expired; a renewed one stays
    assert seen.current() == frozenset([PEERS[0], *PEERS[6:]])
    seen.read([(PEERS[1], 90.0)], now=106.0)  # a record read after it expired (a slow read) never counts
    assert PEERS[1] not in seen.current()
    seen.read([(PEERS[6], 100.0)], now=107.0)  # an older copy of a record does not shorten a newer one's life
    assert PEERS[6] in seen.current()


def test_the_peers_dealt_are_the_training_peers_of_well_formed_records():
    record = {"peer_id": PEERS[0], "client_mode": False, "epoch": 3}
    metadata = {
        b"a": ValueWithExpiration(record, 100.0),
        b"b": ValueWithExpiration({**record, "peer_id": PEERS[1], "client_mode": True}, 100.0),  # in no group
        b"c": ValueWithExpiration({**record, "peer_id": "not bytes"}, 100.0),
        b"d": ValueWithExpiration("not a record", 100.0),
        b"e": ValueWithExpiration({**record, "peer_id": PEERS[2]}, 120.0),
    }
    assert list(training_records(metadata)) == [(PEERS[0], 100.0), (PEERS[2], 120.0)]
    assert list(training_records(None)) == []


def test_offers_of_the_final_state_rank_by_peer_id_between_plain_donors_and_those_an_epoch_ahead():
    ed25519_prefix, sha256_prefix = bytes([0, 36, 8, 1, 18, 32]), bytes([18, 32])
    for prefix in (ed25519_prefix, sha256_prefix):
        keys = [bytes([first]) + bytes(range(31)) for first in (0, 1, 128, 255)]
        keys += [bytes(32), bytes(3) + bytes([1]) + bytes(28)]  # these two differ first in the 4th key byte
        ids = sorted(prefix + key for key in keys)
        for epoch in (9, 2 ** 18):
            ranks = [offer_priority(epoch, peer) for peer in ids]
            assert ranks == sorted(ranks, reverse=True) and len(set(ranks)) == len(ranks)
            assert all(epoch + DONOR_BONUS < rank <= epoch + DONOR_BONUS + OFFER_SPREAD < epoch + 1 for rank in ranks)
