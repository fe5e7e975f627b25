"""Judging the swarm's averaged updates by this peer's held-out loss (averaging/pipeline/update_check.py)."""
from __future__ import annotations

from averaging.api import RoundReport
from averaging.pipeline.defence import Defence, Verdict
from averaging.pipeline.exclusion import ExclusionBook, ExclusionRule, ExclusionWatch
from averaging.pipeline.robust import RobustPolicy
from averaging.pipeline.update_check import UpdateCheck, UpdateCheckRule, refused_peers_line
from tests.peers import wait_until

ME, HONEST, HOSTILE = "me", "honest", ("flip-1", "flip-2", "flip-3")
GROUP = (ME, HONEST, *HOSTILE)


def averaged(check: UpdateCheck, peers=GROUP, outcome: str = "ok") -> None:
    check.round_finished(RoundReport(outcome, 1.0, len(peers), peers=tuple(peers)))


def run(check: UpdateCheck, losses, peers=GROUP):
    """Epochs 1.. with these held-out losses, each after an averaged round of `peers`; what each epoch found."""
    found = []
    for epoch, loss in enumerate(losses, start=1):
        averaged(check, peers)
        found.append(check.epoch_ended(epoch, loss))
    return found


def test_repeated_harmful_updates_refuse_the_peers_of_those_rounds_but_never_this_one():
    check = UpdateCheck(UpdateCheckRule(rise=0.02, harmful=3, window=5), ME)
    check.epoch_ended(0, 5.0)  # where it joined: the first baseline
    found = run(check, [5.2, 5.1, 5.4, 5.7])  # +4%, -2%, +6%, +5.6%: the third harmful one acts
    assert found[:3] == [None, None, None]
    assert found[3].peers == {HONEST, *HOSTILE} and [epoch for epoch, _, _ in found[3].epochs] == [1, 3, 4]
    line = refused_peers_line(found[3])
    assert line.startswith("the swarm's averaged updates raised this peer's held-out loss in 3 of its last 4 epochs "
                           "(epoch 1: 5.000 -> 5.200, epoch 3: 5.100 -> 5.400, epoch 4: 5.400 -> 5.700)")
    assert all(peer in line for peer in (HONEST, *HOSTILE)) and ME not in line.split(": ", 2)[-1]
    # refused once: harmful updates from the same peers are not news
    assert run(check, [6.0, 6.5, 7.0]) == [None, None, None]


def test_an_honest_swarm_whose_loss_rises_now_and_then_is_never_refused():
    check = UpdateCheck(UpdateCheckRule(rise=0.02, harmful=3, window=5), ME)
    check.epoch_ended(0, 5.0)
    # falling, with a rise past 2% every third epoch: never 3 within 5
    losses = [5.0 - 0.05 * epoch + (0.2 if epoch % 3 == 0 else 0.0) for epoch in range(1, 31)]
    assert run(check, losses) == [None] * 30


def test_downloads_rounds_alone_and_failed_rounds_are_not_judged():
    check = UpdateCheck(UpdateCheckRule(rise=0.02, harmful=2, window=5), ME)
    check.epoch_ended(0, 5.0)
    check.round_finished(RoundReport("skipped", 0.0, 1))  # alone: the step was this peer's own
    assert check.epoch_ended(1, 6.0) is None
    check.round_finished(RoundReport("failed", 1.0, 1, "timeout"))
    assert check.epoch_ended(2, 7.0) is None
    averaged(check)
    check.state_loaded()  # a download between: the loss after it is the new baseline
    assert check.epoch_ended(3, 9.0) is None
    assert run(check, [9.1, 9.0]) == [None, None]  # +1.1%: below the rise
    averaged(check, (ME, HONEST), outcome="partial")
    assert check.epoch_ended(6, 9.5) is None  # one harmful update so far
    averaged(check, (ME, "another"))
    found = check.epoch_ended(7, 10.0)
    assert found is not None and found.peers == {HONEST, "another"}


def test_a_non_finite_held_out_loss_judges_nothing_and_resets_the_baseline():
    check = UpdateCheck(UpdateCheckRule(rise=0.02, harmful=1, window=1), ME)
    check.epoch_ended(0, 5.0)
    assert run(check, [float("nan"), 6.0]) == [None, None]  # 6.0 is the baseline after the NaN, not judged
    assert run(check, [7.0])[0].peers == set(GROUP) - {ME}


def test_refused_peers_join_the_excluded_ones_and_outlive_an_exclusion_that_ends():
    """What the averagers refuse is the union; an exclusion with a cool-off ends, a refusal does not."""
    excluded = "12D3KooWFpVSw4FTShHPfXTgjf5fjiiBtY2NdFq4fZDS5FgUFc9S"
    refused = "QmZurcthsZnDEsqwnnY67QJW6mAXMS3VayxHZMFQ6QHNKX"
    clock = [0.0]
    defence = Defence(RobustPolicy())
    watch = ExclusionWatch(defence, ExclusionBook(ExclusionRule(threshold=1, window=1, seconds=5.0),
                                                  clock=lambda: clock[0]))

    def refused_by_the_averagers():
        return {peer.to_base58() for peer in defence.excluded()}

    try:
        defence.report([Verdict(excluded, "round0", "non-finite", "values hold NaN or Inf", dropped=True)])
        wait_until(lambda: refused_by_the_averagers() == {excluded}, timeout=10, message="the exclusion")
        watch.refuse([refused])
        assert refused_by_the_averagers() == {excluded, refused}
        clock[0] = 10.0  # the exclusion's 5 s are over: the watch lets it go at its next poll
        wait_until(lambda: refused_by_the_averagers() == {refused}, timeout=10, message="the exclusion to end")
    finally:
        watch.close()
