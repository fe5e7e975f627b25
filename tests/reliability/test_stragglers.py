"""A slow volunteer does not slow the swarm and ends with its state (issue 30, averaging/pipeline/stragglers.py).

Three real peers in network namespaces (benchmarks/netns.py), one of them on a 2 Mbit/s link both ways; the scenario
is benchmarks/straggler.py's, which measures the epoch rate of the fast peers with and without it. Here: the slow
peer trains in step with the others and all three end with one state. Its measurements are checked too, on
made-up events.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import netns
from benchmarks.straggler import measure, one_run, summarize
from peer.telemetry.events import EpochEnded, ReducingChanged, RoundEnded


@pytest.mark.timeout(360)  # about 55 s alone; peers crawl when the suite runs beside it
async def test_a_peer_on_a_slow_link_trains_in_step_and_ends_with_the_swarms_state(tmp_path: Path):
    reason = netns.unavailable_reason()
    if reason:
        pytest.skip(reason.split(";")[0])
    with netns.Bridge(3) as bridge:
        row = await one_run(bridge, tmp_path, "slow-3", "2mbit", measure_seconds=15.0, raise_errors=True)

    assert row["exit_codes"] == [0, 0, 0], row
    # one swarm, one state: whether its contributions came after the others' grace window (left out, and it took
    # the round's result from reducers whose own rounds were over) or in time, it ends with their state, bit for bit
    assert row["max_parameter_difference"] == 0.0, row
    # every peer trained on: the measuring window waits (up to 120 s) for an epoch of each, and fails without one
    assert row["fast_epochs_per_minute"] > 0 and row["slow_epochs_per_minute"] > 0, row
    # Whether it was late is timing: alone it was left out of every round and stood aside; under suite load the
    # fast peers were once as late as it was. tests/inprocess/test_stragglers.py checks that part with delays far
    # past any window.


def _epoch(epoch: int, at: float) -> EpochEnded:
    return EpochEnded(epoch=epoch, samples=128, seconds=1.0, samples_per_second=32.0, swarm_samples_per_second=96.0,
                      peers=3, time=at)


def test_the_numbers_of_a_run_are_read_from_its_events():
    """benchmarks/straggler.py's measure() and summarize(), on made-up events: a window from 100 to 160."""
    fast = [_epoch(epoch, 95 + 5 * epoch) for epoch in range(14)]  # 12 epochs end in the window
    slow = [_epoch(3, 110), RoundEnded(outcome="ok", seconds=1.0, group_size=3, left_out=1.0, time=111),
            ReducingChanged(reduces=False, time=111), RoundEnded(outcome="ok", seconds=1.0, group_size=3, time=116),
            _epoch(4, 150)]
    row = measure([fast, fast, slow], since=100, until=160, slow=True)
    assert row["fast_epochs_per_minute"] == 12.0 and row["slow_epochs_per_minute"] == 2.0
    assert (row["late_rounds"], row["stood_aside"], row["state_downloads"]) == (1, True, 0)

    rows = [{"setup": "fast-2", "fast_epochs_per_minute": 20.0}, {"setup": "slow-3", "fast_epochs_per_minute": 19.0},
            {"setup": "slow-3-wait", "fast_epochs_per_minute": 8.0}]
    summary = summarize(rows, ["fast-2", "slow-3", "slow-3-wait"])
    assert summary["ratios"]["slow-3/fast-2"]["median"] == 0.95
    assert summary["ratios"]["slow-3-wait/fast-2"]["median"] == 0.4
    assert summary["goal"] == {"min_ratio": 0.9, "met": True}
