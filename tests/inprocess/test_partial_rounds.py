"""Partial rounds: a reducer's part that arrives too late is seen, reported, and settled by a download.

hivemind finishes such a round as if it had succeeded, with this peer's own values where the part
is missing (averaging/pipeline/completeness.py). The first test runs it with real averagers on 127.0.0.1;
the others check what the training side does with it (averaging/strategies/rounds.py).
"""
from __future__ import annotations

import asyncio
import ctypes
import multiprocessing as mp
from typing import AsyncIterator, List

import hivemind
import pytest
import torch
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2

from averaging import adapter
from averaging.api import AveragingHooks, RoundReport, SwarmView
from averaging.deadlines import AdaptiveDeadlines
from averaging.pipeline import completeness, round_pipeline
from averaging.pipeline.round_pipeline import RoundEnd
from averaging.strategies.rounds import DONOR_CHECK_SECONDS, FRESH_READ_SECONDS, SETTLE_SECONDS, RoundKeeper
from averaging.swarm.donor import DonorView
from tests.inprocess.test_averaging import run_in_threads, start_dhts

SIZE = 2 * 2**17  # hivemind gives each of the two reducers a half (smaller vectors go to one)
CHUNK_TIMEOUT = 1.0  # a reducer silent for twice this long is given up on


class AveragerWithSlowReducer(hivemind.averaging.DecentralizedAverager):
    """A peer on a busy CPU: its reducer answers `reducer_delay.value` seconds late.

    Both peers use this class: hivemind names its handlers after the class, so they must match."""

    def __init__(self, *args, **kwargs):
        self.reducer_delay = mp.RawValue(ctypes.c_double, 0.0)  # before the fork: shared with its process
        super().__init__(*args, **kwargs)

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        await asyncio.sleep(self.reducer_delay.value)
        async for message in super().rpc_aggregate_part(stream, context):
            yield message


def average_both(averagers: List, timeout: float = 30.0) -> List[dict]:
    gathered = [None, None]

    def step(index):
        def run():
            gathered[index] = averagers[index].step(timeout=timeout)
        return run

    run_in_threads(step(0), step(1), timeout=timeout + 15)
    return gathered


@pytest.mark.timeout(120)
def test_a_late_reducer_part_makes_the_round_partial_for_the_peer_that_missed_it():
    adapter.install()
    dhts, averagers = start_dhts(2), []
    try:
        for dht, value in zip(dhts, (0.0, 1.0)):
            averagers.append(AveragerWithSlowReducer(
                [torch.full((SIZE,), value)], dht, prefix="partial_test", target_group_size=2, min_group_size=2,
                min_matchmaking_time=1.0, request_timeout=1.0, next_chunk_timeout=CHUNK_TIMEOUT, start=True))
        punctual, slow = averagers

        gathered = average_both(averagers)
        assert [completeness.round_report(averager, 1.0, len(gathered[0])).outcome
                for averager in averagers] == ["ok", "ok"]
        for averager in averagers:
            with averager.get_tensors() as (tensor,):
                assert torch.allclose(tensor, torch.full((SIZE,), 0.5))

        slow.reducer_delay.value = 3 * CHUNK_TIMEOUT  # past the punctual peer's patience for its part
        with punctual.get_tensors() as (tensor,):
            tensor.zero_()
        with slow.get_tensors() as (tensor,):
            tensor.fill_(1.0)
        gathered = average_both(averagers)
        report = completeness.round_report(punctual, 1.0, len(gathered[0]))
        assert report.outcome == "partial"
        assert completeness.missing_fraction(punctual) == pytest.approx(0.5, abs=0.05)
        assert "% of the average" in report.reason
        # the slow peer got every part it waited for: its round was whole, and the two now differ
        assert completeness.missing_fraction(slow) == 0.0
        with punctual.get_tensors() as (mine,), slow.get_tensors() as (theirs,):
            assert (mine - theirs).abs().max() > 0.1

        slow.reducer_delay.value = 0.0
        average_both(averagers)
        assert [completeness.missing_fraction(averager) for averager in averagers] == [0.0, 0.0]
    finally:
        for averager in averagers:
            averager.shutdown()
        for dht in dhts:
            dht.shutdown()


def test_several_all_reduces_of_one_round_are_partial_if_any_was():
    class Averager:
        pass

    averager = Averager()
    pipeline = round_pipeline.attach(averager, [], always=[completeness.Completeness()])
    pipeline.finish(RoundEnd(b"round 1", failed_size=10, total_size=40))
    pipeline.finish(RoundEnd(b"round 1", failed_size=0, total_size=20))  # PowerSGD's second phase
    assert completeness.missing_fraction(averager) == 0.25
    pipeline.finish(RoundEnd(b"round 2", failed_size=0, total_size=40))
    assert completeness.missing_fraction(averager) == 0.0
    assert completeness.missing_fraction(object()) == 0.0  # an averager built before the patches


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def round_keeper(timeout_seconds: float = 20.0):
    reports: List[RoundReport] = []
    keeper = RoundKeeper(AveragingHooks(round_finished=reports.append),
                         AdaptiveDeadlines(matchmaking_seconds=1.0, averaging_timeout_seconds=timeout_seconds))
    keeper.clock = Clock()
    return keeper, reports


AHEAD, NONE = DonorView(ahead=True, smallest_apart=False), DonorView(ahead=False, smallest_apart=False)
SMALLEST = DonorView(ahead=False, smallest_apart=True)


def never_reference():
    raise AssertionError("this peer must not become the reference")


@pytest.mark.parametrize("outcome", ["partial", "failed", "timeout"])
def test_a_round_that_left_this_peer_apart_downloads_once_a_whole_peer_offers_its_state(outcome):
    keeper, reports = round_keeper()
    keeper.finish_round(RoundReport(outcome, 3.0, 2), others_present=True)
    assert reports[-1].outcome == outcome and keeper.apart

    asked = []
    assert not keeper.take_resync(lambda: asked.append(1) or NONE, never_reference)  # nobody ahead yet: train on
    assert not keeper.take_resync(lambda: asked.append(1) or AHEAD, never_reference)  # not asked again so soon
    assert len(asked) == 1 and keeper.apart
    keeper.clock.now += DONOR_CHECK_SECONDS
    assert keeper.take_resync(lambda: AHEAD, never_reference)
    assert not keeper.apart
    assert not keeper.take_resync(lambda: AHEAD, never_reference)  # once


def test_when_every_round_went_wrong_the_smallest_apart_peer_becomes_the_reference_after_a_timeout():
    keeper, _ = round_keeper(timeout_seconds=20.0)
    keeper.finish_round(RoundReport("partial", 3.0, 3), others_present=True)
    became = []
    while keeper.clock.now < 100.0 + 20.0:  # a whole peer may still be finishing its round: wait for it
        assert not keeper.take_resync(lambda: SMALLEST, lambda: became.append(keeper.clock.now))
        keeper.clock.now += DONOR_CHECK_SECONDS
    assert not became and keeper.apart
    keeper.clock.now += DONOR_CHECK_SECONDS
    assert not keeper.take_resync(lambda: SMALLEST, lambda: became.append(keeper.clock.now))
    assert len(became) == 1 and not keeper.apart  # it declares its epoch again; the others download from it


def test_a_window_that_keeps_splitting_the_swarm_is_named_once(caplog):
    keeper, reports = round_keeper()
    short, whole = RoundReport("ok", 1.0, 3), RoundReport("ok", 1.0, 16)
    for report in (short, short, whole, short, short, RoundReport("failed", 1.0, 1)):  # never three short in a row
        keeper.finish_round(report, others_present=True, swarm_peers=16)
    keeper.finish_round(short, others_present=True, swarm_peers=None)  # grouped rounds: short by design
    assert "--matchmaking-seconds" not in caplog.text
    for _ in range(6):
        keeper.finish_round(short, others_present=True, swarm_peers=16)
    assert caplog.text.count("matchmaking window (1s) and average in separate groups") == 1
    assert "this one 3 of 16" in caplog.text and len(reports) == 13


def test_a_peer_that_sees_no_donor_in_two_timeouts_keeps_its_own_state(caplog):
    keeper, _ = round_keeper(timeout_seconds=20.0)
    keeper.finish_round(RoundReport("partial", 3.0, 2), others_present=True)
    for _ in range(79):
        keeper.clock.now += DONOR_CHECK_SECONDS
        assert not keeper.take_resync(lambda: NONE, never_reference)
    assert keeper.apart  # another apart peer with a smaller id may still become the reference
    keeper.clock.now += 2 * DONOR_CHECK_SECONDS
    assert not keeper.take_resync(lambda: NONE, never_reference)
    assert not keeper.apart
    assert "goes on with its own state" in caplog.text


@pytest.mark.parametrize("outcome, others_present", [("ok", True), ("skipped", True), ("partial", False)])
def test_a_whole_round_or_a_lone_peer_needs_no_download(outcome, others_present):
    keeper, _ = round_keeper()
    keeper.finish_round(RoundReport(outcome, 1.0, 2), others_present=others_present)
    assert not keeper.apart
    assert not keeper.take_resync(lambda: AHEAD, never_reference)


def test_a_peer_that_the_swarm_is_already_ahead_of_just_after_its_transition_downloads_once():
    """A peer whose round failed while the others' went on stays one behind."""
    keeper, _ = round_keeper()
    reads = []

    def swarm_at(epoch: int):
        return lambda timeout: reads.append(timeout) or SwarmView(2, 10.0, 0, 64, global_epoch=epoch)

    assert not keeper.behind_after_settling(3, swarm_at(4))  # no transition of its own yet: upstream's rules only
    keeper.entered_epoch()
    keeper.clock.now += SETTLE_SECONDS / 2
    assert not keeper.behind_after_settling(3, swarm_at(4))  # the others of its round may not have reported yet
    assert reads == []
    keeper.clock.now += SETTLE_SECONDS / 2
    assert keeper.behind_after_settling(3, swarm_at(4))
    assert reads == [FRESH_READ_SECONDS]  # on a fresh read of the swarm's progress, not the tracker's last one
    assert not keeper.behind_after_settling(3, swarm_at(4))  # once per epoch

    keeper.entered_epoch()
    keeper.clock.now += SETTLE_SECONDS
    assert not keeper.behind_after_settling(4, swarm_at(4))  # in step
