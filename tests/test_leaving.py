"""Who a peer leaving at --max-epochs still has to wait for (peer.leaving)."""
from __future__ import annotations

from peer.leaving import DONE, DOWNLOADING, Need, has_final_state_elsewhere, leave_record, needs_of_others

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


def test_malformed_records_are_ignored_or_count_as_silence():
    records = {A: "not a dict", B: {"epoch": 10}, b"c": {"epoch": "ten"}}
    assert needs_of_others(10, records, {B: {"state": DONE}}, ME) == {B: Need.GRACE}


def test_a_final_state_exists_elsewhere_only_if_another_peer_reached_our_epoch():
    assert has_final_state_elsewhere(10, progress(me=10, a=10), ME)
    assert has_final_state_elsewhere(10, progress(me=10, a=11), ME)
    assert not has_final_state_elsewhere(10, progress(me=10, a=9), ME)  # the straggler has nothing newer
    assert not has_final_state_elsewhere(10, {ME: {"epoch": 10}, A: {"epoch": "x"}}, ME)
