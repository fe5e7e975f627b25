"""The fault injector (peer/testing/faults.py): each fault happens where and when the plan says, once."""
from __future__ import annotations

import math
import threading
from types import SimpleNamespace

import pytest
import torch

from peer.testing.faults import HOSTILE_PEERS, FaultInjector, FaultPlan, InjectedFault


def test_without_a_plan_nothing_happens():
    faults, loss = FaultInjector(), torch.tensor(2.0)
    assert all(faults.loss(loss) is loss for _ in range(5))
    faults.before_round(0)
    faults.after_epoch(0)


def test_the_loss_of_the_planned_batches_is_nan_and_its_gradient_too():
    faults = FaultInjector(FaultPlan(nan_loss_at_steps=[2, 4]))
    weight = torch.ones(3, requires_grad=True)
    losses = [faults.loss((weight * step).sum()) for step in range(1, 6)]
    assert [math.isnan(float(loss)) for loss in losses] == [False, True, False, True, False]
    losses[1].backward()
    assert torch.isnan(weight.grad).all()


def test_the_gradients_of_the_planned_batches_are_nan_while_their_loss_is_finite():
    faults = FaultInjector(FaultPlan(nan_gradients_at_steps=[2]))
    weight = torch.ones(3, requires_grad=True)
    clean, poisoned = faults.loss((weight * 2).sum()), faults.loss((weight * 3).sum())
    assert float(poisoned) == 9.0
    poisoned.backward()
    assert torch.isnan(weight.grad).all()
    weight.grad = None
    clean.backward()
    assert torch.equal(weight.grad, torch.full((3,), 2.0))


@pytest.mark.parametrize("attack, expected", [("scaled-1e4", 1e4), ("sign-flipped", -1.0)])
def test_a_hostile_peer_scales_every_gradient_and_keeps_its_guard(attack, expected):
    faults = FaultInjector(HOSTILE_PEERS[attack])
    weight = torch.ones(3, requires_grad=True)
    for step in (1.0, 2.0):
        loss = faults.loss((weight * step).sum())
        assert float(loss) == 3 * step  # the loss it reports is honest
        weight.grad = None
        loss.backward()
        assert torch.equal(weight.grad, torch.full((3,), step * expected))
    assert faults.guards_gradients()


def test_a_nan_sender_poisons_every_gradient_and_has_no_guard():
    faults, honest = FaultInjector(HOSTILE_PEERS["nan"]), FaultInjector()
    assert not faults.guards_gradients() and honest.guards_gradients()
    weight = torch.ones(3, requires_grad=True)
    for _ in range(3):
        weight.grad = None
        faults.loss(weight.sum()).backward()
        assert torch.isnan(weight.grad).all()


def test_the_round_at_the_planned_epoch_fails_once():
    faults = FaultInjector(FaultPlan(fail_round_at_epoch=3))
    faults.before_round(2)
    with pytest.raises(InjectedFault, match="epoch 3"):
        faults.before_round(3)
    faults.before_round(3)  # once: the retry goes through


def test_the_stall_comes_after_the_planned_epoch_once_through_the_stop_aware_wait():
    waits = []
    faults = FaultInjector(FaultPlan(stall_after_epoch=2, stall_seconds=7.5), wait=waits.append)
    for epoch in (1, 2, 2, 3):
        faults.after_epoch(epoch)
    assert waits == [7.5]


def test_the_parameters_move_once_at_the_planned_epoch_or_the_first_past_it_that_a_download_reached():
    parameter = torch.arange(8.0)  # noise is scaled by the parameter's spread
    faults = FaultInjector(FaultPlan(perturb_params_at_epoch=5))
    faults.after_epoch(4, [parameter])
    assert torch.equal(parameter, torch.arange(8.0))
    faults.after_epoch(7, [parameter])  # a download skipped epochs 5 and 6
    moved = parameter.clone()
    assert not torch.equal(moved, torch.arange(8.0))
    faults.after_epoch(8, [parameter])
    assert torch.equal(parameter, moved)


def test_a_peer_shares_its_state_unless_the_plan_says_it_serves_none():
    assert FaultInjector().shares_state()
    assert not FaultInjector(FaultPlan(serve_no_state=True)).shares_state()


def test_a_drift_that_a_download_erased_before_the_digests_found_it_comes_back_until_they_do():
    # CI under load: a failed round's download replaced the perturbed state, and no comparison ever saw a drift
    parameter = torch.arange(8.0)
    faults = FaultInjector(FaultPlan(perturb_params_at_epoch=5))
    faults.after_epoch(5, [parameter])
    faults.state_loaded(6)
    parameter.copy_(torch.arange(8.0))  # what the download brought
    faults.after_epoch(6, [parameter])
    assert not torch.equal(parameter, torch.arange(8.0))  # perturbed again
    faults.state_checked(SimpleNamespace(agrees=False))
    faults.state_loaded(7)  # the resync the digests asked for
    parameter.copy_(torch.arange(8.0))
    faults.after_epoch(7, [parameter])
    assert torch.equal(parameter, torch.arange(8.0))  # found once: it stays repaired


@pytest.mark.parametrize("plan", [{"stall_seconds": -1}, {"nan_loss_at_steps": [0]}, {"stall_seconds": "inf"},
                                  {"fail_round_at_epoch": 1.5}, {"unknown": 1},
                                  {"gradient_factor": "nan"}])
def test_a_bad_plan_is_refused(plan):
    with pytest.raises(ValueError):
        FaultPlan.model_validate(plan)


def test_a_test_ends_the_run_at_the_epoch_its_file_holds_once_it_is_written(tmp_path):
    end_file = tmp_path / "end-at-epoch"
    faults = FaultInjector(FaultPlan(end_at_epoch_file=str(end_file)))
    assert faults.max_epochs(30) == 30 and faults.max_epochs(None) is None  # not written yet
    end_file.write_text("not an epoch")
    assert faults.max_epochs(30) == 30
    end_file.write_text("12")
    assert faults.max_epochs(30) == 12 and faults.max_epochs(None) == 12
    assert faults.max_epochs(8) == 8  # --max-epochs still bounds the run
    assert FaultInjector().max_epochs(30) == 30  # without a plan, --max-epochs alone


def test_a_held_peer_joins_once_its_file_exists_or_a_stop_comes(tmp_path):
    turn = tmp_path / "turn"
    waits = []

    def wait(seconds: float) -> bool:  # a stop-aware sleep: the test writes the file on the third wait
        waits.append(seconds)
        if len(waits) == 3:
            turn.touch()
        return False

    FaultInjector(FaultPlan(join_when_file_exists=str(turn)), wait=wait).hold_before_joining()
    assert len(waits) == 3 and turn.exists()

    stopped = threading.Event()
    stopped.set()  # a stop request ends the wait, with the file still missing
    FaultInjector(FaultPlan(join_when_file_exists=str(tmp_path / "never")), wait=stopped.wait).hold_before_joining()
    FaultInjector(wait=lambda seconds: pytest.fail("waited without a plan")).hold_before_joining()
