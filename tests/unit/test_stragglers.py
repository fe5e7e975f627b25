"""Stragglers (averaging/pipeline/stragglers.py): the grace window of a reducer, and a slow peer standing aside.

The reducer is hivemind's, with the window (averaging/adapter/grace.py), driven here directly on an event loop:
senders are coroutines that deliver their parts when told to.
"""
from __future__ import annotations

import asyncio

import pytest
import torch

from averaging.adapter.grace import GracefulPartReducer, load_balance_peers_judging_claims
from averaging.pipeline.stragglers import (
    STANDING_ASIDE_BANDWIDTH,
    GraceWindow,
    ReducerRole,
    claim,
    judged_bandwidths,
    late_arrivals,
)

WINDOW = GraceWindow(ratio=1.0, min_seconds=0.05)


def test_the_window_opens_after_a_majority_and_lasts_as_long_as_they_took():
    assert [WINDOW.quorum(senders) for senders in (1, 2, 3, 4, 5, 8)] == [None, None, 2, 3, 3, 5]
    assert WINDOW.window(0.01) == 0.05  # never shorter than the floor
    assert WINDOW.window(2.0) == 2.0
    assert GraceWindow(ratio=0.5, min_seconds=0.05).window(2.0) == 1.0
    assert GraceWindow(ratio=0).quorum(5) is None  # off: wait for everyone, as hivemind does


def run(coroutine):
    return asyncio.new_event_loop().run_until_complete(asyncio.wait_for(coroutine, 30))


def parts(value: float, count: int = 1):
    return [torch.full((4,), value) for _ in range(count)]


async def deliver(reducer, sender: int, values, delay: float = 0.0):
    """A sender that delivers its parts in order, after `delay`; returns what it was answered for each."""
    await asyncio.sleep(delay)
    return [await reducer.accumulate_part(sender, index, part) for index, part in enumerate(values)]


def test_a_latecomer_is_left_out_and_still_receives_the_average_of_the_others():
    async def scenario():
        reducer = GracefulPartReducer([torch.Size([4])] * 2, num_senders=3, grace=WINDOW)
        return reducer, await asyncio.gather(deliver(reducer, 0, parts(1.0, 2)), deliver(reducer, 1, parts(3.0, 2)),
                                             deliver(reducer, 2, parts(100.0, 2), delay=1.0))
    reducer, answers = run(scenario())
    # both parts averaged without the latecomer, and every sender, the latecomer too, got the same tensors
    for answer in answers:
        assert [part.tolist() for part in answer] == [[2.0] * 4, [2.0] * 4]
    assert reducer.left_out == {2}
    assert [reducer.left_out_of(2, part) for part in (0, 1)] == [True, True]
    assert not any(reducer.left_out_of(sender, part) for sender in (0, 1) for part in (0, 1))


def test_a_sender_late_only_for_a_later_part_counts_in_the_earlier_ones():
    async def scenario():
        reducer = GracefulPartReducer([torch.Size([4])] * 2, num_senders=3, grace=WINDOW)

        async def stalls_after_the_first_part():
            first = await reducer.accumulate_part(2, 0, torch.full((4,), 5.0))
            await asyncio.sleep(1.0)
            return [first, await reducer.accumulate_part(2, 1, torch.full((4,), 100.0))]
        return reducer, await asyncio.gather(deliver(reducer, 0, parts(1.0, 2)), deliver(reducer, 1, parts(3.0, 2)),
                                             stalls_after_the_first_part())
    reducer, answers = run(scenario())
    for answer in answers:
        assert [part[0].item() for part in answer] == [3.0, 2.0]  # (1 + 3 + 5) / 3, then (1 + 3) / 2
    assert [reducer.left_out_of(2, part) for part in (0, 1)] == [False, True]


@pytest.mark.parametrize("senders, grace", [(2, WINDOW), (3, GraceWindow(ratio=0))])
def test_without_a_quorum_or_a_window_the_reducer_waits_for_everyone(senders, grace):
    async def scenario():
        reducer = GracefulPartReducer([torch.Size([4])], num_senders=senders, grace=grace)
        delivered = [deliver(reducer, sender, parts(float(sender))) for sender in range(senders - 1)]
        return reducer, await asyncio.gather(*delivered, deliver(reducer, senders - 1, parts(9.0), delay=0.5))
    reducer, answers = run(scenario())
    mean = (sum(range(senders - 1)) + 9.0) / senders
    assert all(answer[0][0].item() == pytest.approx(mean) for answer in answers)
    assert reducer.left_out == set()


def test_a_latecomer_that_then_fails_is_not_counted_out_twice():
    async def scenario():
        reducer = GracefulPartReducer([torch.Size([4])] * 2, num_senders=4, grace=WINDOW)
        fast = [deliver(reducer, sender, parts(float(sender), 2)) for sender in range(3)]
        late = asyncio.ensure_future(deliver(reducer, 3, parts(100.0, 2), delay=5.0))
        answers = await asyncio.gather(*fast)
        reducer.on_sender_failed(3)  # upstream bans a sender whose stream broke: it is out already
        late.cancel()
        return reducer, answers
    reducer, answers = run(scenario())
    assert all([part[0].item() for part in answer] == [1.0, 1.0] for answer in answers)
    assert reducer.left_out == {3} and reducer.finished.is_set()


def test_replies_after_the_window_are_late_and_only_in_groups_of_three_or_more():
    assert late_arrivals({"a": 0.0, "b": 0.04, "c": 0.6}, WINDOW) == {"c"}  # quorum 0.04 s, window to 0.09 s
    assert late_arrivals({"a": 0.0, "b": 0.5, "c": 0.9}, WINDOW) == set()  # the quorum took long: so may the rest
    assert late_arrivals({"a": 0.0, "b": 0.2, "c": 0.3, "d": 9.0}, WINDOW) == {"d"}
    assert late_arrivals({"a": 0.0, "b": 9.0}, WINDOW) == set()


def test_a_member_most_others_found_late_gets_nothing_to_reduce_and_every_member_computes_the_same():
    fast_a, fast_b, slow = claim(None, ["slow"], "a"), claim(None, ["slow"], "b"), claim(None, ["a"], "slow")
    assert judged_bandwidths([fast_a, slow, fast_b]) == [None, 0.0, None]
    # one report is not a majority of two others: the slow peer's own view of a fast one changes nothing
    assert judged_bandwidths([fast_a, claim(None, [], "slow"), claim(None, [], "b")]) == [None, None, None]
    # a peer standing aside declares 0 itself; plain values (hivemind's own averagers) pass through
    assert judged_bandwidths([claim(0.0, [], "x"), 5.0, None]) == [0.0, 5.0, None]
    # groups of two are never judged
    assert judged_bandwidths([claim(None, ["b"], "a"), claim(None, ["a"], "b")]) == [None, None]


def test_load_balancing_gives_a_judged_member_no_part_and_a_group_all_standing_aside_an_even_split():
    fast_a, fast_b, slow = claim(None, ["slow"], "a"), claim(None, ["slow"], "b"), claim(None, [], "slow")
    assert load_balance_peers_judging_claims(100, [fast_a, slow, fast_b]) == (50, 0, 50)
    assert load_balance_peers_judging_claims(100, [0.0, 0.0]) == (50, 50)
    assert load_balance_peers_judging_claims(100, [None, STANDING_ASIDE_BANDWIDTH, None]) == (50, 0, 50)


def test_a_late_peer_stands_aside_until_it_is_in_time_for_long_enough_and_longer_after_a_relapse():
    role = ReducerRole(on_time_rounds_to_return=2, most_rounds_to_return=8)
    assert role.observe(late=False, whole=True) is None and role.reduces
    assert role.observe(late=True, whole=True) is False and role.bandwidth == STANDING_ASIDE_BANDWIDTH
    assert role.observe(late=False, whole=False) is None  # a failed round says nothing of its timing
    assert role.observe(late=False, whole=True) is None
    assert role.observe(late=False, whole=True) is True and role.bandwidth is None
    # late again right after coming back: it waits twice as long this time
    assert role.observe(late=True, whole=True) is False
    assert [role.observe(late=False, whole=True) for _ in range(4)] == [None, None, None, True]
    # in time for as long as it waited: the next relapse does not lengthen the wait
    for _ in range(4):
        assert role.observe(late=False, whole=True) is None
    assert role.observe(late=True, whole=True) is False
    assert [role.observe(late=False, whole=True) for _ in range(4)] == [None, None, None, True]
