"""averaging/adapter/epoch_keys.py: rounds that lead to different epochs never share a group, with real
hivemind averagers in this process."""
from __future__ import annotations

from types import SimpleNamespace
from typing import List

import hivemind
import pytest
import torch
from hivemind.averaging.allreduce import AllreduceException
from hivemind.utils import MSGPackSerializer

from averaging import adapter
from averaging.adapter.epoch_keys import ChosenGroup, epoch_group_key, gather_epochs, round_epoch

LOCALHOST = ["/ip4/127.0.0.1/tcp/0"]


def step_gathering(gathered) -> SimpleNamespace:
    """A round's control as its averager process sees it (DecentralizedAverager.step packs what it gathers so)."""
    return SimpleNamespace(data_for_gather=MSGPackSerializer.dumps([100.0, 0, MSGPackSerializer.dumps(gathered)]))


def test_a_round_that_gathers_an_epoch_is_keyed_by_it_and_any_other_keeps_upstreams_key():
    assert round_epoch(step_gathering(12)) == 12
    for other in (None, {"epoch": 12}, "12", True, 1.5):
        assert round_epoch(step_gathering(other)) is None, other
    assert round_epoch(SimpleNamespace(data_for_gather=b"\x00garbage")) is None

    manager = SimpleNamespace(prefix="run_grad_averager", group_bits="01", round_epoch=12)
    assert epoch_group_key(manager) == "run_grad_averager_e12.0b01"
    assert hivemind.averaging.key_manager.is_valid_group(epoch_group_key(manager))  # hivemind declares it
    manager.round_epoch = None
    assert epoch_group_key(manager) == "run_grad_averager.0b01"


def test_a_grouped_round_is_keyed_by_its_epoch_and_the_group_chosen_for_that_epoch():
    chosen = ChosenGroup()
    assert chosen.of_round(12) is None  # nothing chosen yet: the epoch's key
    chosen.choose(12, 3)
    assert chosen.of_round(12) == 3 and chosen.of_round(13) is None and chosen.of_round(None) is None
    manager = SimpleNamespace(prefix="run_state_averager", group_bits="", round_epoch=12, round_group=3)
    assert epoch_group_key(manager) == "run_state_averager_e12g3.0b"
    assert hivemind.averaging.key_manager.is_valid_group(epoch_group_key(manager))
    manager.round_group = None
    assert epoch_group_key(manager) == "run_state_averager_e12.0b"


def test_gather_epochs_fills_in_the_epoch_a_round_leads_to_unless_the_caller_gathers_something():
    calls = []
    averager = SimpleNamespace(schedule_step=lambda *args, **kwargs: calls.append(kwargs))
    epoch = [4]
    gather_epochs(averager, lambda: epoch[0] + 1)
    averager.schedule_step(timeout=3.0)
    epoch[0] = 6
    averager.schedule_step(gather=None)
    averager.schedule_step(gather=2)
    assert calls == [dict(timeout=3.0, gather=5), dict(gather=7), dict(gather=2)]


def start_averagers(count: int) -> List[hivemind.averaging.DecentralizedAverager]:
    adapter.install()  # the patches reach the averager processes at fork
    first = hivemind.DHT(start=True, host_maddrs=LOCALHOST)
    dhts = [first] + [hivemind.DHT(start=True, host_maddrs=LOCALHOST, initial_peers=first.get_visible_maddrs())
                      for _ in range(count - 1)]
    return [hivemind.averaging.DecentralizedAverager(
        [torch.full((16,), float(index))], dht, prefix="epochs", min_matchmaking_time=2.0, request_timeout=0.5,
        start=True) for index, dht in enumerate(dhts)]


def shut_down(averagers) -> None:
    for averager in averagers:
        averager.shutdown()
        averager.dht.shutdown()


@pytest.mark.timeout(120)
def test_peers_whose_rounds_lead_to_the_same_epoch_average_and_a_peer_one_epoch_behind_is_left_out():
    averagers = start_averagers(3)
    try:
        # the third peer is one epoch behind: its round leads to epoch 7 while the others' lead to 8
        controls = [averager.step(gather=epoch, timeout=8.0, allow_retries=False, wait=False)
                    for averager, epoch in zip(averagers, (8, 8, 7))]
        gathered = controls[0].result(timeout=60)
        assert gathered == controls[1].result(timeout=60)
        assert sorted(gathered.values()) == [8, 8], gathered  # the peer of epoch 7 was not in their group
        with pytest.raises(AllreduceException, match="could not find a group"):  # alone under its epoch's key
            controls[2].result(timeout=60)
        for index in (0, 1):
            with averagers[index].get_tensors() as (tensor,):
                assert torch.equal(tensor, torch.full((16,), 0.5))
        with averagers[2].get_tensors() as (tensor,):
            assert torch.equal(tensor, torch.full((16,), 2.0))  # untouched
    finally:
        shut_down(averagers)
