"""averaging/swarm/claims.py and the download backoff: a forged progress record cannot freeze a swarm
(tests/reliability/test_untrusted.py shows it with real peers)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from averaging.api import AveragingHooks
from averaging.deadlines import AdaptiveDeadlines
from averaging.strategies.rounds import RoundKeeper
from averaging.swarm.claims import EPOCH_LEAD, MAX_TARGETS_OF_SAMPLES, ClaimFilter, is_paused

TARGET = 100
NOW = 1000.0
ME, HONEST, LIAR = b"me", b"honest", b"liar"


def entry(epoch: int, samples: int = 0, rate: float = 50.0, written: float = NOW, expires: float = NOW + 30):
    value = dict(peer_id=b"x", epoch=epoch, samples_accumulated=samples, samples_per_second=rate, time=written,
                 client_mode=False)
    return SimpleNamespace(value=value, expiration_time=expires)


def claims() -> ClaimFilter:
    return ClaimFilter(ME, TARGET, max_ttl_seconds=40.0, max_clock_skew_seconds=5.0)


@pytest.mark.parametrize("lie", [
    entry(3, samples=MAX_TARGETS_OF_SAMPLES * TARGET + 1),  # 10^12 samples, in spirit
    entry(3, rate=1e9),
    entry(3, written=NOW + 3600),  # a clock an hour ahead
    entry(3, expires=NOW + 7200),  # would outlive its peer for hours
])
def test_absurd_records_are_dropped_and_their_owner_ignored_for_the_rest_of_the_run(lie):
    believed = claims()
    assert set(believed.filter({ME: entry(3), HONEST: entry(3), LIAR: lie}, NOW)) == {ME, HONEST}
    assert set(believed.filter({ME: entry(3), LIAR: entry(3)}, NOW + 1)) == {ME}  # later plausible: still ignored
    assert believed.ignored == {LIAR}


def test_with_longer_rounds_an_epoch_may_hold_as_many_more_samples():
    """DiLoCo's round factor (--max-round-factor) makes an epoch up to that many target batches long."""
    longer = ClaimFilter(ME, TARGET, max_ttl_seconds=40.0, max_clock_skew_seconds=5.0, longest_round=4)
    honest = entry(3, samples=4 * MAX_TARGETS_OF_SAMPLES * TARGET)
    assert set(longer.filter({ME: entry(3), HONEST: honest}, NOW)) == {ME, HONEST}
    assert set(claims().filter({ME: entry(3), HONEST: honest}, NOW)) == {ME}


def test_a_newcomer_believes_its_first_look_and_judges_jumps_from_then_on():
    believed = claims()
    assert set(believed.filter({ME: entry(0), HONEST: entry(31)}, NOW)) == {ME, HONEST}  # it is behind, legitimately
    # 10 s at the believed 50 + 50 samples/s plus the claimant's own 50, x3 margin, 100 per epoch: 31 + lead + 45
    later = NOW + 10
    kept = believed.filter({ME: entry(0), HONEST: entry(40), LIAR: entry(10**9, written=later)}, later)
    assert set(kept) == {ME, HONEST}
    # 10 s more from epoch 40, which the swarm reached at `later`: at most 40 + lead + 45
    bound = 40 + EPOCH_LEAD + 45
    kept = believed.filter({ME: entry(0), HONEST: entry(bound), b"hasty": entry(bound + 1)}, later + 10)
    assert set(kept) == {ME, HONEST}
    assert believed.ignored == set()  # only doubted: epochs beyond the bound are not believed for now


def test_a_peer_that_trained_alone_becomes_believable_at_its_own_pace():
    believed = claims()
    believed.filter({ME: entry(0, rate=0.0), HONEST: entry(5, rate=0.0)}, NOW)
    fast = {ME: entry(0, rate=0.0), HONEST: entry(5, rate=0.0), b"alone": entry(60, rate=100.0)}
    assert set(believed.filter(fast, NOW + 1)) == {ME, HONEST}  # 5 + lead + 3 at most, one second in
    assert set(believed.filter(fast, NOW + 20)) == {ME, HONEST, b"alone"}  # 5 + lead + 60 by now


def test_a_peer_stuck_for_a_while_still_believes_a_swarm_that_went_on_at_its_usual_pace():
    believed = claims()
    believed.filter({ME: entry(3), HONEST: entry(3, rate=100.0), b"other": entry(3, rate=100.0)}, NOW)
    # then a fetch while the others sat between epochs (rate 0 in their records), and this peer is stuck 10 s
    believed.filter({ME: entry(4, rate=0.0), HONEST: entry(4, rate=0.0), b"other": entry(4, rate=0.0)}, NOW + 1)
    ahead = {ME: entry(4, rate=0.0), HONEST: entry(60, rate=0.0), b"other": entry(60, rate=0.0)}
    assert set(believed.filter(ahead, NOW + 11)) == set(ahead)  # 4 + lead + 10 s x 200/s x 3 / 100 = 72


def test_a_fresh_peers_own_record_sets_no_reference_but_a_trained_one_does():
    believed = claims()
    believed.filter({ME: entry(0, rate=0.0)}, NOW)  # alone and fresh: nothing known about the swarm
    assert set(believed.filter({ME: entry(0, rate=0.0), HONEST: entry(50)}, NOW + 1)) == {ME, HONEST}
    alone = claims()
    alone.filter({ME: entry(2)}, NOW, local_epoch=3)  # it trained three epochs alone (its record lags): it knows
    assert set(alone.filter({ME: entry(3), LIAR: entry(10**9)}, NOW + 1, local_epoch=3)) == {ME}


def test_a_claim_that_made_a_newcomer_download_is_judged_by_what_was_served():
    believed = claims()
    assert set(believed.filter({ME: entry(0), HONEST: entry(31), LIAR: entry(10**9)}, NOW)) == {ME, HONEST, LIAR}
    believed.served(31, NOW + 1)  # the download brought epoch 31: nobody could serve 10^9
    assert set(believed.filter({ME: entry(31), HONEST: entry(31), LIAR: entry(10**9)}, NOW + 1.5)) == {ME, HONEST}


def test_this_peers_own_record_is_always_believed():
    believed = claims()
    believed.filter({HONEST: entry(5)}, NOW)
    assert set(believed.filter({ME: entry(10**9, rate=1e9, written=NOW + 3600)}, NOW + 1)) == {ME}
    assert believed.ignored == set()


def test_withdrawn_records_pass_through_for_hivemind_to_skip():
    believed = claims()
    gone = SimpleNamespace(value=None, expiration_time=NOW + 10)
    assert believed.filter({HONEST: gone}, NOW) == {HONEST: gone}


def test_failed_downloads_back_off_and_a_successful_one_resets():
    clock = SimpleNamespace(now=0.0)
    rounds = RoundKeeper(AveragingHooks(), AdaptiveDeadlines(matchmaking_seconds=1.0, averaging_timeout_seconds=5.0))
    rounds.clock = lambda: clock.now

    def fail():
        raise RuntimeError("no peer sent its state")

    assert rounds.download_allowed()
    assert rounds.download_state(fail) is False
    assert not rounds.download_allowed()
    clock.now = 2.0
    assert rounds.download_allowed()
    assert rounds.download_state(fail) is False
    clock.now = 5.9
    assert not rounds.download_allowed()  # the second wait is twice the first
    clock.now = 6.0
    assert rounds.download_state(lambda: None) is True
    assert rounds.download_allowed()
    for _ in range(12):  # never more than a minute between attempts
        rounds.download_state(fail)
    clock.now += 60.0
    assert rounds.download_allowed()



def test_records_of_excluded_peers_are_not_believed():
    excluded = set()
    believed = ClaimFilter(ME, TARGET, max_ttl_seconds=40.0, max_clock_skew_seconds=5.0, excluded=lambda: excluded)
    records = {ME: entry(3), HONEST: entry(3), LIAR: entry(3)}
    records[LIAR].value["peer_id"] = b"liar-peer"
    assert set(believed.filter(records, NOW)) == {ME, HONEST, LIAR}
    excluded.add(b"liar-peer")
    assert set(believed.filter(records, NOW + 1)) == {ME, HONEST}


def test_a_paused_peers_record_counts_no_peer_while_one_that_has_not_stepped_yet_does():
    """A peer whose only partner paused must see itself alone, or it waits out every round's matchmaking."""
    paused, fresh = entry(3, rate=1e-20), entry(3, rate=1e-20)
    paused.value["client_mode"] = True  # as averaging/swarm/progress.py stand_idle writes it
    assert is_paused(paused.value) and not is_paused(fresh.value)
    assert set(claims().filter({ME: entry(3), LIAR: paused, HONEST: fresh}, NOW)) == {ME, HONEST}
    training_client = entry(3, samples=10)  # a client-mode peer (behind NAT) that trains counts, as before
    training_client.value["client_mode"] = True
    assert not is_paused(training_client.value)
    assert set(claims().filter({ME: entry(3), HONEST: training_client}, NOW)) == {ME, HONEST}


def test_one_of_two_other_peers_ahead_does_not_make_a_right_clock_blame_itself(caplog):
    believed = claims()
    swarm = {ME: entry(3), HONEST: entry(3), LIAR: entry(3, written=NOW + 3600, expires=NOW + 3630)}
    with caplog.at_level("WARNING"):
        assert set(believed.filter(swarm, NOW)) == {ME, HONEST}  # the record from the future is the one ignored
    assert believed.clock_offset == 0.0 and "behind the swarm's" not in caplog.text


def test_a_peer_whose_own_clock_is_wrong_says_so_and_blames_nobody(caplog):
    believed = claims()
    hour = 3600.0
    swarm = {ME: entry(3), **{bytes([n]): entry(3, written=NOW + hour - 5, expires=NOW + hour + 25) for n in range(3)}}
    with caplog.at_level("WARNING"):
        kept = believed.filter(swarm, NOW)  # our clock is an hour behind theirs
    assert set(kept) == set(swarm) and believed.ignored == set()
    assert "this peer's clock is at least 3585s behind the swarm's" in caplog.text  # 3625 - the 40 s lifetime
    assert abs(believed.clock_offset - hour) <= 40
    in_sync = {ME: entry(3), **{bytes([n]): entry(3) for n in range(3)}}
    assert set(believed.filter(in_sync, NOW + 1)) == set(in_sync) and believed.clock_offset == 0.0
