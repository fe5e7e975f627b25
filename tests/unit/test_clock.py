"""dht/clock.py: a peer finds its own clock ahead of the others' from their live clock records."""
from __future__ import annotations

import logging

from dht.clock import ClockJudge

A, B, C = b"a", b"b", b"c"
PERIOD, SKEW = 5.0, 5.0


def test_a_clock_an_hour_ahead_says_so_once_and_again_when_it_agrees(caplog):
    judge = ClockJudge(max_skew_seconds=SKEW, period_seconds=PERIOD)
    with caplog.at_level(logging.INFO, logger="dht.clock"):
        judge.look({A: 100.0, B: 101.0}, now=3702.0)  # a first look: nothing is known to be live yet
        assert judge.lead_seconds is None
        for step in range(1, 4):
            judge.look({A: 100.0 + 5 * step, B: 101.0 + 5 * step}, now=3702.0 + 5 * step)
        # the last look: lags 3602 and 3601 s (the lower median 3601), less the 5 s a record may be old
        assert judge.lead_seconds == 3596.0
        assert caplog.text.count("this peer's clock is at least") == 1
        assert "ahead of the clocks of 2 other peer(s)" in caplog.text
        judge.look({A: 121.0, B: 122.0}, now=123.0)  # the clock was set right
    assert judge.lead_seconds is None and "agrees with the swarm's again" in caplog.text


def test_records_up_to_a_period_old_or_from_departed_peers_are_no_evidence(caplog):
    judge = ClockJudge(max_skew_seconds=SKEW, period_seconds=PERIOD)
    with caplog.at_level(logging.INFO, logger="dht.clock"):
        judge.look({A: 100.0, B: 100.0, C: 10.0}, now=100.0)
        # a and b rewrote theirs a period ago (a right clock); c left long ago: its record never changes
        judge.look({A: 105.0, B: 105.0, C: 10.0}, now=110.0 + SKEW)
        judge.look({A: 110.0, B: 110.0, C: 10.0}, now=115.0 + SKEW)
    assert judge.lead_seconds is None and "clock is at least" not in caplog.text


def test_one_peer_ahead_among_honest_ones_does_not_make_them_blame_their_own_clocks():
    honest = ClockJudge(max_skew_seconds=SKEW, period_seconds=PERIOD)
    honest.look({A: 100.0, B: 3700.0}, now=100.0)
    honest.look({A: 105.0, B: 3705.0}, now=106.0)  # b writes an hour in the future; a agrees with us
    honest.look({A: 110.0, B: 3710.0, C: 110.0}, now=111.0)
    assert honest.lead_seconds is None


def test_one_peer_behind_among_two_does_not_make_a_right_clock_look_ahead():
    judge = ClockJudge(max_skew_seconds=SKEW, period_seconds=PERIOD)
    judge.look({A: 100.0, B: -3500.0}, now=100.0)
    judge.look({A: 105.0, B: -3495.0}, now=106.0)  # b's clock is an hour behind; a agrees with us
    assert judge.lead_seconds is None
