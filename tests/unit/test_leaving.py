"""Who a peer leaving at --max-epochs still has to wait for (peer.runtime.leaving)."""
from __future__ import annotations

from peer.runtime.leaving import (
    DONE,
    DOWNLOADING,
    PAUSED,
    Need,
    Source,
    everyone_else_done,
    everyone_else_leaving,
    final_state_source,
    has_final_state_elsewhere,
    has_peer_behind,
    leave_record,
    may_have_final_state,
    may_join_round_to,
    may_publish_digest,
    needs_of_others,
    seen_at_epoch,
)

ME, A, B = b"me", b"a", b"b"


def progress(**epochs: int) -> dict:
    return {name.encode(): {"epoch": epoch, "samples_accumulated": 0} for name, epoch in epochs.items()}


def test_a_peer_behind_is_served_until_it_catches_up():
    assert needs_of_others(10, progress(me=10, a=9), {}, ME) == {A: Need.SERVE}


def test_a_peer_that_announces_a_download_is_served_even_at_our_epoch():
    leaving = {A: leave_record(10, DOWNLOADING)}
    assert needs_of_others(10, progress(me=10, a=10), leaving, ME) == {A: Need.SERVE}


def test_a_silent_peer_at_our_epoch_gets_a_grace_period():
    assert needs_of_others(10, progress(me=10, a=10), {}, ME) == {A: Need.GRACE}


def test_done_or_ahead_needs_nothing():
    leaving = {A: leave_record(10, DONE)}
    assert needs_of_others(10, progress(me=10, a=10, b=11), leaving, ME) == {A: Need.NOTHING, B: Need.NOTHING}


def test_a_peer_done_at_a_lower_max_epochs_needs_nothing():
    assert needs_of_others(10, progress(a=6), {A: leave_record(6, DONE)}, ME) == {A: Need.NOTHING}


def test_a_leave_record_from_an_earlier_epoch_is_stale():
    """A peer restarted under the same identity: its old 'done' says nothing about its current epoch."""
    leaving = {A: leave_record(6, DONE), B: leave_record(3, DOWNLOADING)}
    assert needs_of_others(10, progress(a=9, b=10), leaving, ME) == {A: Need.SERVE, B: Need.GRACE}


def test_a_leave_record_ahead_of_a_lagging_progress_record_gives_the_epoch():
    """hivemind stops publishing the progress of a peer that accumulates no samples: one that downloaded the state
    at epoch 10 and left at once still has a progress record at 9, but its own leave record says 10."""
    offered = {A: leave_record(10, DONE, offers=True)}
    assert final_state_source(10, progress(me=10, a=9), offered, ME) is Source.DOWNLOAD
    assert needs_of_others(10, progress(me=10, a=9), offered, ME) == {A: Need.NOTHING}
    assert everyone_else_done(progress(me=10, a=9), offered, ME)
    downloading = {A: leave_record(10, DOWNLOADING)}  # failed at 10 too: the smaller id offers, the other waits
    assert final_state_source(10, progress(me=10, a=9), downloading, ME) is Source.WAIT
    assert final_state_source(10, progress(a=10, b=9), {B: leave_record(10, DOWNLOADING)}, A) is Source.OFFER


def test_a_peer_whose_state_was_downloaded_at_the_epoch_waits_for_an_offer_and_is_not_waited_for():
    """A straggler that downloaded a failed peer's state at the last epoch holds a copy of it: the failed peer
    offers its own without waiting for the copy's holder, who takes the offer and never offers in its place."""
    copy = {A: leave_record(10, DOWNLOADING, downloaded=True)}
    assert final_state_source(10, progress(me=10, a=9), copy, ME) is Source.OFFER  # a has the smaller id
    failed = {ME: leave_record(10, DOWNLOADING)}
    assert final_state_source(10, progress(me=10, a=10), failed, A, candidate=False) is Source.WAIT
    assert final_state_source(10, progress(me=10, a=10), failed, A, waits=1, candidate=False) is Source.WAIT
    offered = {ME: leave_record(10, DONE, offers=True)}
    assert final_state_source(10, progress(me=10, a=10), offered, A, candidate=False) is Source.DOWNLOAD


def test_malformed_records_are_ignored_or_count_as_silence():
    records = {A: "not a dict", B: {"epoch": 10}, b"c": {"epoch": "ten"}}
    assert needs_of_others(10, records, {B: {"state": DONE}}, ME) == {B: Need.GRACE}


def test_only_a_done_from_every_other_peer_lets_a_peer_leave_before_its_stay_is_over():
    done = {A: leave_record(10, DONE), B: leave_record(6, DONE)}
    assert everyone_else_done(progress(me=10, a=10, b=6), done, ME)
    assert not everyone_else_done(progress(me=10, a=10, b=6), {A: done[A]}, ME)  # b has not said it is done
    assert not everyone_else_done(progress(me=10, a=11), {}, ME)  # ahead, training on: not a "done"
    assert not everyone_else_done(progress(me=10, a=10), {A: leave_record(9, DONE)}, ME)  # a stale record
    assert not everyone_else_done(progress(me=10), {}, ME)  # alone: nobody said anything yet


def test_a_swarm_whose_other_peers_all_announced_leaving_will_form_no_round_again():
    """A straggler one epoch behind peers that reached --max-epochs: its rounds can be dropped."""
    leaving = {A: leave_record(10, DOWNLOADING), B: leave_record(10, DONE)}
    assert everyone_else_leaving(progress(me=9, a=10, b=10), leaving, ME)
    assert not everyone_else_leaving(progress(me=9, a=10, b=10), {A: leaving[A]}, ME)  # b may still train
    assert not everyone_else_leaving(progress(me=9, a=10), {A: leave_record(8, DONE)}, ME)  # stale: a restarted
    assert not everyone_else_leaving(progress(me=9), {}, ME)


def test_a_round_to_an_epoch_can_be_joined_only_by_a_peer_still_behind_it_that_has_not_said_it_leaves():
    """Rounds meet only rounds to the same epoch: a straggler whose round leads to 10 waits for nobody once the
    others are at 10."""
    assert may_join_round_to(10, progress(me=9, a=9, b=10), {}, ME)
    assert not may_join_round_to(10, progress(me=9, a=10, b=11), {}, ME)
    assert not may_join_round_to(10, progress(me=9, a=9), {A: leave_record(9, DONE)}, ME)  # a left at 9
    assert not may_join_round_to(10, progress(me=9, a=9), {A: leave_record(10, DOWNLOADING)}, ME)  # newer
    assert may_join_round_to(10, progress(me=9, a=9), {A: leave_record(7, DONE)}, ME)  # stale: a restarted
    assert not may_join_round_to(10, progress(me=9), {}, ME)


def test_where_rounds_run_once_their_epoch_began_a_peer_at_that_epoch_may_still_join():
    """local-sgd: a peer that reached epoch 10 averages its parameters toward 10 in the background."""
    assert may_join_round_to(10, progress(me=10, a=10), {}, ME, at_epoch=True)
    assert not may_join_round_to(10, progress(me=10, a=10), {}, ME)
    assert not may_join_round_to(10, progress(me=10, a=11), {}, ME, at_epoch=True)  # a is in its round to 11
    assert not may_join_round_to(10, progress(me=10, a=10), {A: leave_record(10, DONE)}, ME, at_epoch=True)


def test_a_final_state_exists_elsewhere_only_if_another_peer_reached_our_epoch():
    assert has_final_state_elsewhere(10, progress(me=10, a=10), ME)
    assert has_final_state_elsewhere(10, progress(me=10, a=11), ME)
    assert not has_final_state_elsewhere(10, progress(me=10, a=9), ME)  # the straggler has nothing newer
    assert not has_final_state_elsewhere(10, {ME: {"epoch": 10}, A: {"epoch": "x"}}, ME)


def test_a_failed_peer_downloads_once_a_peer_at_its_epoch_offers_its_state():
    undecided = {A: leave_record(10, DOWNLOADING)}
    assert final_state_source(10, progress(me=10, a=10, b=10), undecided, ME) is Source.WAIT  # b has not said
    offered = {**undecided, B: leave_record(10, DONE, offers=True)}
    assert final_state_source(10, progress(me=10, a=10, b=10), offered, ME) is Source.DOWNLOAD


def test_a_failed_peer_downloads_from_a_peer_ahead():
    assert final_state_source(10, progress(me=10, a=11), {}, ME) is Source.DOWNLOAD
    assert final_state_source(10, progress(me=10, a=11), {A: leave_record(11, DONE)}, ME) is Source.DOWNLOAD


def test_an_offer_is_taken_at_once_whatever_the_order_of_the_records_and_while_others_are_silent():
    """Seen with 16 peers in groups: a peer whose first record read was a silent peer's waited, while another
    peer offered the final state, until every offering peer had left; then it offered its own, and the peers still
    there took it."""
    offered = {B: leave_record(10, DONE, offers=True)}
    for records in (progress(me=10, a=10, b=10), progress(me=10, b=10, a=10), progress(me=10, a=9, b=10)):
        assert final_state_source(10, records, offered, ME) is Source.DOWNLOAD
        assert final_state_source(10, records, offered, ME, candidate=False) is Source.DOWNLOAD


def test_when_every_peer_at_the_epoch_failed_the_smallest_id_offers_and_the_others_wait_for_it():
    everyone_failed = {owner: leave_record(10, DOWNLOADING) for owner in (ME, A, B)}
    records = progress(me=10, a=10, b=10)
    assert final_state_source(10, records, everyone_failed, A) is Source.OFFER  # b"a" < b"b" < b"me"
    assert final_state_source(10, records, everyone_failed, B) is Source.WAIT
    assert final_state_source(10, records, everyone_failed, ME) is Source.WAIT
    a_offers = {**everyone_failed, A: leave_record(10, DONE, offers=True)}
    assert final_state_source(10, records, a_offers, B) is Source.DOWNLOAD


def test_once_the_wait_is_over_silent_peers_count_as_failed_and_only_the_smallest_id_offers():
    """Seen under load: every peer's last round failed, two said 'downloading' and the third stayed silent in a
    round of its own; when the first two gave up waiting, each downloaded the other's state, and kept it."""
    records = progress(me=10, a=10, b=10)
    two_failed = {ME: leave_record(10, DOWNLOADING), B: leave_record(10, DOWNLOADING)}  # a is silent
    assert final_state_source(10, records, two_failed, B) is Source.WAIT
    assert final_state_source(10, records, two_failed, B, waits=1) is Source.WAIT  # for a's offer
    assert final_state_source(10, records, two_failed, ME, waits=1) is Source.WAIT
    assert final_state_source(10, records, two_failed, A, waits=1) is Source.OFFER
    a_offers = {**two_failed, A: leave_record(10, DONE, offers=True)}
    assert final_state_source(10, records, a_offers, B, waits=1) is Source.DOWNLOAD
    # after a second wait, a peer still silent is busy in a round of its own: the smallest id that said it
    # downloads offers, and the silent peer downloads that offer once it is done
    assert final_state_source(10, records, two_failed, B, waits=2) is Source.OFFER
    assert final_state_source(10, records, two_failed, ME, waits=2) is Source.WAIT
    b_offers = {**two_failed, B: leave_record(10, DONE, offers=True)}
    assert final_state_source(10, records, b_offers, ME, waits=2) is Source.DOWNLOAD
    assert final_state_source(10, records, b_offers, A) is Source.DOWNLOAD
    # a peer behind is no longer waited for
    behind = progress(me=10, a=9, b=10)
    assert final_state_source(10, behind, {ME: leave_record(10, DOWNLOADING)}, B) is Source.WAIT
    assert final_state_source(10, behind, {ME: leave_record(10, DOWNLOADING)}, B, waits=1) is Source.OFFER


def test_a_peer_one_epoch_behind_may_be_in_its_last_round_and_is_waited_for_unless_done_there():
    """A peer whose last round failed at once can reach the last epoch before its group has averaged."""
    assert may_have_final_state(10, progress(me=10, a=9), ME) and not may_have_final_state(10, progress(a=8), ME)
    assert final_state_source(10, progress(me=10, a=9), {}, ME) is Source.WAIT
    assert final_state_source(10, progress(me=10, a=9), {A: leave_record(9, DONE)}, ME) is Source.OFFER


def test_a_peer_done_at_the_epoch_without_an_offer_holds_the_final_state_and_one_far_behind_is_not_waited_for():
    """It took the final state by download (or its offer did not show in time): offering this peer's own state
    instead would leave two states (16 peers in groups: the peers still there took a late peer's offer)."""
    records = progress(me=10, a=10, b=8)
    assert final_state_source(10, records, {A: leave_record(10, DONE, offers=False)}, ME) is Source.DOWNLOAD
    assert final_state_source(10, records, {A: leave_record(10, DOWNLOADING, downloaded=True)}, ME) is Source.OFFER
    stale_offer = {A: leave_record(9, DONE, offers=True)}  # from an earlier epoch: a is silent at 10
    assert final_state_source(10, records, stale_offer, ME) is Source.WAIT


def test_a_peer_one_epoch_behind_is_a_straggler_that_may_download_this_peers_state():
    me, other = b"me", b"other"
    assert has_peer_behind(10, {me: {"epoch": 10}, other: {"epoch": 9}}, me)
    assert not has_peer_behind(10, {me: {"epoch": 9}, other: {"epoch": 10}}, me)  # this peer's own record
    assert not has_peer_behind(10, {other: {"epoch": 8}}, me) and not has_peer_behind(10, {}, me)


def test_the_last_epochs_digests_are_awaited_only_from_peers_that_may_still_publish_one():
    # c: at the epoch; d: one behind, in its last round; a: downloading (its round failed: no digest until it holds
    # the final state, maybe this peer's); b: far behind; e: paused; f: done at a lower --max-epochs
    records = progress(me=10, a=10, b=7, c=10, d=9, e=10, f=9)
    leaving = {A: leave_record(10, DOWNLOADING), b"e": leave_record(10, PAUSED), b"f": leave_record(9, DONE)}
    assert may_publish_digest(10, records, leaving, ME) == 2
    leaving[b"c"] = leave_record(10, DONE, offers=True)  # published before it offered
    assert may_publish_digest(10, records, leaving, ME) == 2


def test_what_a_peer_waiting_for_the_final_state_sees_is_counted_for_its_log():
    records = progress(me=10, a=10, b=9, c=10, d=11, e=7)
    leaving = {A: leave_record(10, DONE, offers=True), b"c": leave_record(10, DOWNLOADING), b"e": leave_record(7, DONE)}
    seen = seen_at_epoch(10, records, leaving, ME)
    assert seen == "1 done at it, 1 downloading at it, 1 silent ahead, 1 silent behind"
    assert seen_at_epoch(10, progress(me=10, e=7), {}, ME) == "no other peer"
