"""An optimizer whose state is made before its first step (averaging/adapter/fresh_optimizer.py) moves nothing when
it is made, and then steps exactly as the same optimizer fresh from torch."""
from __future__ import annotations

import pytest
import torch

from averaging.adapter.fresh_optimizer import make_fresh_state_, with_fresh_state

OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.1, weight_decay=0.5),
    "adam-l2": lambda params: torch.optim.Adam(params, lr=0.1, weight_decay=0.5),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.5),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_made_state_moves_nothing_and_the_steps_are_those_of_a_fresh_optimizer(name: str):
    torch.manual_seed(0)
    start = torch.randn(4, 3)
    made, fresh = start.clone().requires_grad_(), start.clone().requires_grad_()
    made_optimizer = with_fresh_state(OPTIMIZERS[name])([made])
    fresh_optimizer = OPTIMIZERS[name]([fresh])
    assert torch.equal(made.detach(), start) and made.grad is None
    assert all(torch.is_tensor(value) for value in made_optimizer.state[made].values())  # the tensors exist
    for _ in range(3):
        gradient = torch.randn(4, 3)
        for param, optimizer in ((made, made_optimizer), (fresh, fresh_optimizer)):
            param.grad = gradient.clone()
            optimizer.step()
        assert torch.allclose(made.detach(), fresh.detach(), atol=1e-7, rtol=0)


def test_hivemind_zero_gradient_step_is_what_it_replaces():
    """hivemind's own way moves the parameters (weight decay) and bias-corrects one step ahead."""
    from hivemind.optim.state_averager import initialize_optimizer_state_

    start = torch.ones(2)
    theirs, fresh = start.clone().requires_grad_(), start.clone().requires_grad_()
    their_optimizer, fresh_optimizer = OPTIMIZERS["adamw"]([theirs]), OPTIMIZERS["adamw"]([fresh])
    initialize_optimizer_state_(their_optimizer)
    assert not torch.equal(theirs.detach(), start)
    theirs.grad, fresh.grad = torch.ones(2), torch.ones(2)
    their_optimizer.step(), fresh_optimizer.step()
    assert not torch.allclose(theirs.detach(), fresh.detach(), atol=1e-3)


def test_an_optimizer_whose_state_is_already_made_is_left_alone():
    param = torch.ones(3, requires_grad=True)
    optimizer = torch.optim.Adagrad([param], lr=0.1, initial_accumulator_value=0.3)  # makes its state at once
    make_fresh_state_(optimizer)
    assert torch.equal(optimizer.state[param]["sum"], torch.full((3,), 0.3))
    assert torch.equal(param.detach(), torch.ones(3))
