"""averaging/adapter/epoch_keys.py: rounds that lead to different epochs never share a group, with real
hivemind averagers in this process."""
from __future__ import annotations

import time
from types import SimpleNamespace
from typing import List, Optional

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
    chosen.choose(12, 3, 5)
    assert chosen.of_round(12) == (3, 5) and chosen.of_round(13) is None and chosen.of_round(None) is None
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


class GroupedAverager(hivemind.averaging.DecentralizedAverager):
    """An averager whose rounds look for the group chosen in `chosen`, as ReportingStateAverager's do (none: the
    epoch's key, as the gradient averagers' rounds)."""

    def __init__(self, *args, chosen: Optional[ChosenGroup], **kwargs):
        self.chosen = chosen
        super().__init__(*args, **kwargs)

    def run(self):
        if self.chosen is not None:
            self.chosen.use()
        super().run()


def start_averagers(count: int, min_matchmaking_time: float = 2.0,
                    chosen: Optional[ChosenGroup] = None) -> List[GroupedAverager]:
    adapter.install()  # the patches reach the averager processes at fork
    first = hivemind.DHT(start=True, host_maddrs=LOCALHOST)
    dhts = [first] + [hivemind.DHT(start=True, host_maddrs=LOCALHOST, initial_peers=first.get_visible_maddrs())
                      for _ in range(count - 1)]
    return [GroupedAverager([torch.full((16,), float(index))], dht, prefix="epochs", chosen=chosen,
                            min_matchmaking_time=min_matchmaking_time, request_timeout=0.5, start=True)
            for index, dht in enumerate(dhts)]


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


@pytest.mark.timeout(120)
def test_a_grouped_round_waits_past_one_window_for_the_peers_dealt_to_it_and_closes_once_they_are_all_in():
    """Three peers dealt into one group, and a fourth that deals itself into it too (a peer that sees another
    swarm): two start, then two more after one window (6 s). With one window, the first two averaged as a pair and
    the others as another; with no count, all four averaged together. The round waits three windows for the three
    dealt to it, and its leader turns away whoever comes once they are in."""
    chosen = ChosenGroup()
    chosen.choose(8, 0, 3)  # shared before the averager processes fork: every round to epoch 8 is group 0 of 3
    averagers = start_averagers(4, min_matchmaking_time=6.0, chosen=chosen)
    try:
        controls = [averager.step(gather=8, timeout=15.0, allow_retries=False, wait=False)
                    for averager in averagers[:2]]
        time.sleep(8.0)  # past the first two's window, within their round
        controls += [averager.step(gather=8, timeout=15.0, allow_retries=False, wait=False)
                     for averager in averagers[2:]]
        outcomes = []
        for control in controls:
            try:
                outcomes.append(len(control.result(timeout=60)))
            except AllreduceException as error:
                assert "could not find a group" in str(error)
                outcomes.append(0)
        assert outcomes[:2] == [3, 3] and sorted(outcomes[2:]) == [0, 3], outcomes
        results = []
        for index, (averager, outcome) in enumerate(zip(averagers, outcomes)):
            with averager.get_tensors() as (tensor,):
                results.append(tensor.clone())
            if not outcome:
                assert torch.equal(results[-1], torch.full((16,), float(index)))  # untouched
        grouped = [result for result, outcome in zip(results, outcomes) if outcome]
        assert all(torch.equal(result, grouped[0]) for result in grouped)
        assert not torch.equal(grouped[0], torch.zeros(16))  # averaged: averager 0 started at zeros
    finally:
        shut_down(averagers)


@pytest.mark.timeout(120)
def test_a_grouped_round_that_finds_nobody_stops_looking_after_two_of_its_windows_not_at_its_timeout():
    """A peer that comes after its group has closed finds nobody under its key. Its window is 3 x 1 s, so it gives up
    after 6 s, long before its round's timeout (60 s): before, it waited out the whole timeout."""
    chosen = ChosenGroup()
    chosen.choose(8, 0, 2)
    (averager,) = start_averagers(1, min_matchmaking_time=1.0, chosen=chosen)
    try:
        control = averager.step(gather=8, timeout=60.0, allow_retries=True, wait=False)
        with pytest.raises(AllreduceException, match="could not find a group"):
            control.result(timeout=40)  # a TimeoutError here: it was still looking
    finally:
        shut_down([averager])
