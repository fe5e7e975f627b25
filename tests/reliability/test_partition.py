"""A 2+2 partition heals (issue 30): both halves train while cut off, each says the swarm looks split, and once the
link is back the four peers find each other again and end with one state.

Four real peers in network namespaces (benchmarks/netns.py), the link between {0, 1} and {2, 3} cut for 40 s and
restored; the scenario and its numbers are benchmarks/partition.py's, which measures the same run for time (its
measurements are checked here too, on made-up events).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import netns
from benchmarks.partition import HALVES, measure, one_run
from peer.telemetry.events import EpochEnded, StateDownloaded, SwarmRejoined, SwarmSplit
from tests.peers import ONE_CROWD_AT_A_TIME

CUT_SECONDS = 40.0


@ONE_CROWD_AT_A_TIME
@pytest.mark.timeout(420)  # about 130 s alone; peers crawl when the suite runs beside it
async def test_a_partitioned_swarm_trains_on_both_sides_says_so_and_heals(tmp_path: Path):
    reason = netns.unavailable_reason()
    if reason:
        pytest.skip(reason.split(";")[0])
    with netns.Bridge(4) as bridge:
        row = await one_run(bridge, tmp_path, CUT_SECONDS, settle_seconds=15.0, raise_errors=True)

    # during the cut, each half kept training on its own: the half without the first peer too
    assert all(epochs > 0 for epochs in row["epochs_during_cut"]), f"{row}"
    # each half said the swarm looks split, naming the other half, in its events and its log
    ids = row["peer_ids"]
    for half, other in (HALVES, HALVES[::-1]):
        for index in half:
            assert row["split_unreachable"][index] is not None, f"peer-{index} reported no split: {row}"
            assert {ids[peer] for peer in other} <= set(row["split_unreachable"][index]), f"{row}"
            assert row["split_logged"][index], f"peer-{index} did not log the split"
    # after the heal: every peer reached the other half again, and counted all four peers (awaited by one_run)
    assert None not in row["rejoined_after_seconds"], f"{row}"
    assert row["one_swarm_after_seconds"] is not None, f"{row}"
    assert row["exit_codes"] == [0, 0, 0, 0], f"{row}"
    # one swarm, one state: the half that was behind adopted the other's state, bit for bit (a swarm still split
    # ends about 1e-1 apart)
    assert row["max_parameter_difference"] == 0.0, f"{row}"


def _epoch(epoch: int, at: float, peers: int) -> EpochEnded:
    return EpochEnded(epoch=epoch, samples=32, seconds=1.0, samples_per_second=32.0, swarm_samples_per_second=64.0,
                      peers=peers, time=at)


def test_the_numbers_of_a_run_are_read_from_its_events():
    """benchmarks/partition.py's measure(), on made-up events: cut at 100, healed at 140, asked to end at 170."""
    half_a, half_b = ["A0", "A1"], ["B0", "B1"]
    events = [
        [_epoch(5, 101, 4), _epoch(6, 110, 2), SwarmSplit(reachable=2, unreachable=["B0"], time=112),
         SwarmSplit(reachable=2, unreachable=["B0", "B1"], time=113), _epoch(7, 139, 2),
         SwarmRejoined(peers=["B0", "B1"], time=141), _epoch(8, 146, 4)],
        [_epoch(5, 101, 4), SwarmSplit(reachable=2, unreachable=["B0", "B1"], time=112),
         SwarmRejoined(peers=["B0", "B1"], time=142), _epoch(8, 145, 4)],
        [SwarmSplit(reachable=2, unreachable=["A0", "A1"], time=114), _epoch(5, 130, 2),
         SwarmRejoined(peers=half_a, time=141.5), StateDownloaded(epoch=8, time=150), _epoch(9, 151, 4),
         StateDownloaded(epoch=12, time=171)],  # a download at the end of the run is not a resync
        [SwarmSplit(reachable=2, unreachable=["A0", "A1"], time=114), _epoch(5, 130, 2), _epoch(9, 152, 4)],
    ]
    row = measure(events, cut_at=100, healed_at=140, ended_at=170)
    assert row["epochs_during_cut"] == [3, 1]  # 5, 6, 7 and 5
    assert row["longest_stall_during_cut_seconds"] == [29.0, 30.0]
    assert row["split_reported_after_seconds"] == [12, 12, 14, 14]
    assert row["split_unreachable"] == [half_b, half_b, half_a, half_a]
    assert row["rejoined_after_seconds"] == [1, 2, 1.5, None]
    assert row["one_swarm_after_seconds"] == 12  # the last peer to count all four, at 152
    assert row["last_resync_after_seconds"] == 10 and row["quiet_seconds_before_end"] == 20
