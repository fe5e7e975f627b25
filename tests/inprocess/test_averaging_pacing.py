"""The pacing in averaging/adapter/:
hivemind's matchmaking lookups and donor declarations are spaced out,
and none is lost."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from hivemind.averaging.averager import DecentralizedAverager
from hivemind.averaging.key_manager import GroupKeyManager

from averaging.adapter import pacing


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_pacer_spaces_calls_and_queues_callers_that_arrive_together():
    clock = FakeClock()
    pacer = pacing.Pacer(0.1, clock=clock)
    assert pacer.delay() == 0.0
    assert pacer.delay() == pytest.approx(0.1)  # same moment: waits one interval
    assert pacer.delay() == pytest.approx(0.2)  # and the next queues behind it
    clock.now += 1.0
    assert pacer.delay() == 0.0  # after a quiet spell nobody waits


async def test_back_to_back_group_lookups_wait_for_their_slot(monkeypatch):
    lookups, slept = [], []

    class FakeDHT:
        peer_id = "me"

        async def get(self, key, latest, return_future):
            lookups.append(key)
            return None

    async def record_sleep(seconds):
        slept.append(seconds)

    monkeypatch.setattr(GroupKeyManager, "get_averagers", pacing.paced_get_averagers)
    monkeypatch.setattr(pacing.asyncio, "sleep", record_sleep)
    manager = GroupKeyManager(FakeDHT(), "run_grad_averager", "", None)
    manager._lookup_pacer = pacing.Pacer(pacing.LOOKUP_INTERVAL_SECONDS, clock=FakeClock())
    for _ in range(3):
        assert await manager.get_averagers(manager.current_key, only_active=True) == []
    assert lookups == [manager.current_key] * 3
    assert slept == pytest.approx([0.0, pacing.LOOKUP_INTERVAL_SECONDS, 2 * pacing.LOOKUP_INTERVAL_SECONDS])


async def test_a_burst_of_state_updates_is_declared_a_few_times_and_the_newest_priority_goes_out(monkeypatch):
    monkeypatch.setattr(pacing, "DECLARE_INTERVAL_SECONDS", 0.05)
    stored = []

    class FakeDHT:
        async def store(self, key, subkey, value, expiration_time, return_future):
            stored.append((key, value))
            return True

    averager = SimpleNamespace(
        _matchmaking=SimpleNamespace(group_key_manager=SimpleNamespace(prefix="run_state_averager")),
        allow_state_sharing=True, state_sharing_priority=0, declare_state_period=30.0,
        dht=FakeDHT(), peer_id=SimpleNamespace(to_bytes=lambda: b"me"), _state_updated=asyncio.Event(),
    )
    declaring = asyncio.create_task(pacing.paced_declare_for_download_periodically(averager))
    try:
        updates = 200  # an all-reduce marks the state updated once per averaged tensor
        for priority in range(1, updates + 1):
            averager.state_sharing_priority = priority
            averager._state_updated.set()
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.2)  # time for the last update to go out
    finally:
        declaring.cancel()
        await asyncio.gather(declaring, return_exceptions=True)

    assert all(key == "run_state_averager.all_averagers" for key, _ in stored)
    # unpaced, nearly every update is its own store; paced, at most one per interval (plus the first)
    assert 2 <= len(stored) < updates / 4, len(stored)
    assert stored[-1][1] == updates


def test_building_an_optimizer_installs_the_pacing(monkeypatch):
    from averaging.config import AveragingConfig
    from averaging.strategies.factory import build_swarm_optimizer

    monkeypatch.setattr(GroupKeyManager, "get_averagers", pacing.unpaced_get_averagers)
    monkeypatch.setattr(DecentralizedAverager, "_declare_for_download_periodically", None)
    with pytest.raises(AttributeError):  # the replica is unusable on purpose: only what happens first matters
        build_swarm_optimizer(AveragingConfig(target_batch_size=8), replica=None)
    assert GroupKeyManager.get_averagers is pacing.paced_get_averagers
    assert DecentralizedAverager._declare_for_download_periodically is pacing.paced_declare_for_download_periodically


class CountingEvent:
    def __init__(self):
        self.sets = 0

    def set(self):
        self.sets += 1


def test_progress_reports_are_paced_but_an_epoch_or_a_reset_goes_at_once(monkeypatch):
    """A step's report stores the tracker's record at most once a REPORT_INTERVAL_SECONDS: others extrapolate a
    record by its rate. A new epoch, its first samples, or fewer samples (a reset) are reported at once."""
    clock = FakeClock()
    monkeypatch.setattr(pacing.time, "monotonic", clock)
    progress = SimpleNamespace(epoch=0, samples_accumulated=0)
    tracker = SimpleNamespace(
        local_progress=progress, global_progress=SimpleNamespace(epoch=0, samples_accumulated=0),
        performance_ema=SimpleNamespace(update=lambda task_size: None, reset_timer=lambda: None),
        _get_local_progress=lambda epoch, samples: SimpleNamespace(epoch=epoch, samples_accumulated=samples),
        should_report_progress=CountingEvent(),
    )
    for step in range(1, 11):  # ten steps within a tenth of the interval
        pacing.paced_report_local_progress(tracker, 0, 16 * step)
        clock.now += pacing.REPORT_INTERVAL_SECONDS / 100
    assert tracker.should_report_progress.sets == 1  # the epoch's first samples, then nothing until the slot
    assert tracker.global_progress.samples_accumulated == 160  # the tracker's own view is never paced
    assert tracker.local_progress.samples_accumulated == 160  # what the reporter stores when it wakes
    clock.now += pacing.REPORT_INTERVAL_SECONDS
    pacing.paced_report_local_progress(tracker, 0, 176)
    assert tracker.should_report_progress.sets == 2  # its slot came
    pacing.paced_report_local_progress(tracker, 1, 0)
    assert tracker.should_report_progress.sets == 3  # a new epoch goes at once
    pacing.paced_report_local_progress(tracker, 1, 16)
    assert tracker.should_report_progress.sets == 4  # and its first samples (upstream stops a peer that has none)
    pacing.paced_report_local_progress(tracker, 1, 32)
    assert tracker.should_report_progress.sets == 4
    pacing.paced_report_local_progress(tracker, 1, 0)
    assert tracker.should_report_progress.sets == 5  # and so does a reset
