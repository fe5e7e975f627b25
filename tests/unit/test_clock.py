"""dht/clock.py: a peer finds its own clock ahead of the others' from their live clock records."""
from __future__ import annotations

import logging

from dht.clock import LOOKS_TO_JUDGE, ClockJudge

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


def test_writers_slowed_by_load_are_late_not_a_sign_of_a_fast_clock(caplog):
    """Eight peers on 2 cores: every writer's thread ran late, its records were 10-13 s old when read, and every
    peer warned that its clock was ahead. A writer's own stamps show how long its interval really was."""
    judge = ClockJudge(max_skew_seconds=SKEW, period_seconds=PERIOD)
    with caplog.at_level(logging.INFO, logger="dht.clock"):
        for look in range(6):  # each writer rewrites every 16 s instead of 5; each record is read 14 s old
            written = 100.0 + 16 * look
            judge.look({A: written, B: written + 1, C: written + 2}, now=written + 16)
    assert judge.lead_seconds is None and "clock is at least" not in caplog.text


def test_one_late_look_is_no_skew_and_a_lag_that_holds_is(caplog):
    judge = ClockJudge(max_skew_seconds=SKEW, period_seconds=PERIOD)
    with caplog.at_level(logging.INFO, logger="dht.clock"):
        judge.look({A: 100.0, B: 100.0}, now=101.0)
        judge.look({A: 105.0, B: 105.0}, now=122.0)  # this peer's own look ran 16 s late once
        judge.look({A: 110.0, B: 110.0}, now=111.0)
        judge.look({A: 115.0, B: 115.0}, now=116.0)
        assert judge.lead_seconds is None
        for look in range(LOOKS_TO_JUDGE):  # now this clock jumps 12 s ahead, and stays there
            judge.look({A: 120.0 + 5 * look, B: 120.0 + 5 * look}, now=121.0 + 5 * look + 12)
    assert judge.lead_seconds == 8.0 and caplog.text.count("this peer's clock is at least 8s ahead") == 1
