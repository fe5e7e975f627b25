"""averaging/swarm/open_rounds.py: a leaving peer drops rounds that found no group, and only those."""
from __future__ import annotations

import contextlib
import time
import weakref

import hivemind
import pytest
import torch
from hivemind.averaging.control import AveragingStage
from hivemind.utils import MSGPackSerializer

from averaging import adapter
from averaging.swarm.open_rounds import RoundAbandoner
from tests.peers import wait_until


class FakeRound:
    def __init__(self, stage: AveragingStage, done: bool = False, epoch=None):
        self.stage, self._done, self.cancelled = stage, done, False
        # as DecentralizedAverager.step packs what a round gathers: our rounds gather the epoch they lead to
        self.data_for_gather = MSGPackSerializer.dumps([0.0, 0, MSGPackSerializer.dumps(epoch)])

    def done(self) -> bool:
        return self._done or self.cancelled

    def cancel(self) -> bool:
        self.cancelled = True
        return True


class FakeClock:
    def __init__(self):
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def test_only_rounds_still_looking_for_a_group_after_the_grace_are_cancelled(monkeypatch):
    looking = FakeRound(AveragingStage.LOOKING_FOR_GROUP)
    grouped = FakeRound(AveragingStage.AWAITING_TRIGGER)  # its groupmates wait for our part: let it finish
    running = FakeRound(AveragingStage.RUNNING_ALLREDUCE)
    finished = FakeRound(AveragingStage.LOOKING_FOR_GROUP, done=True)
    rounds = [looking, grouped, running, finished]
    monkeypatch.setattr(adapter, "open_rounds", weakref.WeakSet(rounds))
    clock = FakeClock()
    abandoner = RoundAbandoner(leaving=lambda: True, grace_seconds=lambda: 2.0, clock=clock)

    assert abandoner.poll() == 0  # first seen now: it may still find its group
    clock.now += 1.9
    assert abandoner.poll() == 0
    clock.now += 0.1
    assert abandoner.poll() == 1
    assert looking.cancelled and not any(r.cancelled for r in (grouped, running, finished))


def test_a_round_to_an_epoch_that_nobody_else_can_reach_is_cancelled_after_the_grace_and_no_other(monkeypatch):
    """A peer the others left behind: its round leads to epoch 8, and every other peer is at 8 or past it."""
    behind = FakeRound(AveragingStage.LOOKING_FOR_GROUP, epoch=8)
    joinable = FakeRound(AveragingStage.LOOKING_FOR_GROUP, epoch=9)
    no_epoch = FakeRound(AveragingStage.LOOKING_FOR_GROUP)
    grouped = FakeRound(AveragingStage.RUNNING_ALLREDUCE, epoch=8)
    monkeypatch.setattr(adapter, "open_rounds", weakref.WeakSet([behind, joinable, no_epoch, grouped]))
    clock, asked = FakeClock(), []
    abandoner = RoundAbandoner(leaving=lambda: False, grace_seconds=lambda: 2.0, clock=clock,
                               nobody_joins=lambda epoch: asked.append(epoch) or epoch <= 8)
    assert abandoner.poll() == 0 and not asked  # first seen now: it may still find its group
    clock.now += 2.0
    assert abandoner.poll() == 1
    assert behind.cancelled and not any(r.cancelled for r in (joinable, no_epoch, grouped))
    assert sorted(asked) == [8, 9]


def test_whether_to_drop_rounds_is_asked_only_while_one_looks_for_a_group(monkeypatch):
    """leaving() may read the DHT (are all the other peers leaving?): not four times a second for nothing."""
    rounds = [FakeRound(AveragingStage.RUNNING_ALLREDUCE)]
    monkeypatch.setattr(adapter, "open_rounds", weakref.WeakSet(rounds))
    asked = []
    abandoner = RoundAbandoner(leaving=lambda: asked.append(True) or True, grace_seconds=lambda: 0.0,
                               poll_seconds=0.01)
    abandoner.start()
    try:
        time.sleep(0.3)
        assert not asked
        looking = FakeRound(AveragingStage.LOOKING_FOR_GROUP)
        rounds.append(looking)
        monkeypatch.setattr(adapter, "open_rounds", weakref.WeakSet(rounds))
        wait_until(lambda: looking.cancelled, 10, message="the looking round to be cancelled")
        assert asked and not rounds[0].cancelled
    finally:
        abandoner.finish()


def test_whether_to_drop_rounds_is_asked_only_once_a_round_has_looked_longer_than_the_grace(monkeypatch):
    """A round normally finds its group within its matchmaking window: until it has not, the DHT is not read."""
    looking = FakeRound(AveragingStage.LOOKING_FOR_GROUP)
    monkeypatch.setattr(adapter, "open_rounds", weakref.WeakSet([looking]))
    clock, asked = FakeClock(), []
    abandoner = RoundAbandoner(leaving=lambda: asked.append(True) or True, grace_seconds=lambda: 2.0, clock=clock)
    assert abandoner.poll() == 0  # first seen now
    clock.now += 1.9
    assert abandoner.poll() == 0 and not asked
    clock.now += 0.1
    assert abandoner.poll() == 1 and asked == [True] and looking.cancelled


def test_a_round_that_finds_its_group_while_leaving_is_asked_runs_on(monkeypatch):
    looking = FakeRound(AveragingStage.LOOKING_FOR_GROUP)
    monkeypatch.setattr(adapter, "open_rounds", weakref.WeakSet([looking]))

    def leaving() -> bool:  # a DHT read takes a while: meanwhile the round found its group
        looking.stage = AveragingStage.RUNNING_ALLREDUCE
        return True

    assert RoundAbandoner(leaving=leaving, grace_seconds=lambda: 0.0, clock=FakeClock()).poll() == 0
    assert not looking.cancelled


@pytest.fixture
def lone_averager():
    """An averager with nobody to meet: alone, each of its rounds would look for a group for its whole timeout."""
    adapter.install()
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    averager = None
    try:
        averager = hivemind.averaging.DecentralizedAverager(
            [torch.zeros(8)], dht, prefix="lonely", min_matchmaking_time=1.0, request_timeout=0.5, start=True,
        )
        yield averager
    finally:
        if averager is not None:
            averager.shutdown()
        dht.shutdown()


@contextlib.contextmanager
def running(abandoner: RoundAbandoner):
    abandoner.start()
    try:
        yield abandoner
    finally:
        abandoner.finish()


@pytest.mark.timeout(120)
def test_a_real_round_to_an_epoch_nobody_else_can_reach_is_cancelled_long_before_its_timeout(lone_averager):
    control = lone_averager.step(gather=8, timeout=60, wait=False)  # as our rounds gather the epoch they lead to
    with running(RoundAbandoner(leaving=lambda: False, grace_seconds=lambda: 1.0, poll_seconds=0.1,
                                nobody_joins=lambda epoch: epoch == 8)):
        wait_until(control.done, 30, message="the round to end")
    assert control.cancelled()


@pytest.mark.timeout(120)
def test_a_leaving_peer_cancels_its_real_round_that_nobody_joins(lone_averager):
    control = lone_averager.step(timeout=60, wait=False)
    assert control in set(adapter.open_rounds)
    leaving = []
    with running(RoundAbandoner(leaving=lambda: bool(leaving), grace_seconds=lambda: 1.0, poll_seconds=0.1)):
        wait_until(lambda: control.stage == AveragingStage.LOOKING_FOR_GROUP, 20, message="matchmaking to start")
        leaving.append(True)
        wait_until(control.done, 30, message="the round to end")
    assert control.cancelled()
