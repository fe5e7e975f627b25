"""Each peer's own data order, continued across restarts (peer/tasks/order.py)."""
from __future__ import annotations

import itertools

import pytest

from peer.tasks.order import DataOrder, DataPosition, resume_position, seed_for_peer


def first(order: DataOrder, count: int) -> list:
    return list(itertools.islice(iter(order), count))


def test_each_pass_reads_every_sample_once_in_its_own_permutation():
    stream = first(DataOrder(50, seed=7), 150)
    passes = [stream[index:index + 50] for index in range(0, 150, 50)]
    assert all(sorted(one) == list(range(50)) for one in passes)
    assert passes[0] != passes[1] != passes[2]


def test_a_seed_fixes_the_order_and_another_seed_changes_it():
    assert first(DataOrder(1000, seed=3), 200) == first(DataOrder(1000, seed=3), 200)
    assert first(DataOrder(1000, seed=3), 200) != first(DataOrder(1000, seed=4), 200)


@pytest.mark.parametrize("start", [0, 1, 49, 50, 73, 500])
def test_an_order_started_later_is_the_rest_of_the_same_stream(start):
    """What a restarted peer reads is what it would have read next, across pass boundaries too."""
    whole = first(DataOrder(50, seed=11), start + 120)
    assert first(DataOrder(50, seed=11, start=start), 120) == whole[start:]


def test_peers_of_a_run_get_their_own_seeds_and_keep_them():
    seeds = {seed_for_peer("run", f"Qm{index}") for index in range(20)}
    assert len(seeds) == 20
    assert seed_for_peer("run", "QmA") == seed_for_peer("run", "QmA") != seed_for_peer("other-run", "QmA")
    assert all(0 <= seed < 2**32 for seed in seeds)


def test_a_recorded_position_is_resumed_unless_another_seed_is_chosen():
    recorded = DataPosition(seed=5, samples_read=640).state_dict()
    assert resume_position(recorded, None, own_seed=9) == DataPosition(5, 640)
    assert resume_position(recorded, 5, own_seed=9) == DataPosition(5, 640)
    assert resume_position(recorded, 6, own_seed=9) == DataPosition(6, 0)  # another order, from its start
    assert resume_position(None, None, own_seed=9) == DataPosition(9, 0)
    assert resume_position(None, 6, own_seed=9) == DataPosition(6, 0)


@pytest.mark.parametrize("size, start", [(0, 0), (10, -1)])
def test_an_order_over_nothing_or_before_its_start_is_refused(size, start):
    with pytest.raises(ValueError):
        DataOrder(size, seed=0, start=start)
