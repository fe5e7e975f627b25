"""The task's optimizer, with its state tensors made before the first step and still those of a fresh optimizer.

hivemind averages and serves optimizer statistics as fixed tensors, so its TrainingStateAverager makes them, for an
optimizer whose state is still empty, by running one step with zero gradients. That step is not nothing: it runs at
the optimizer's learning rate, so weight decay shrinks every parameter once (AdamW: by lr x weight_decay), and it
counts, so Adam bias-corrects every later update one step ahead of the moments it holds. The first real update of
AdamW was 0.74x the one plain torch makes from the same gradients (tests/inprocess/test_large_batch.py).

Here the zero-gradient step runs at learning rate 0, and every statistic and step counter it made is then reset to
zero: the tensors exist, and the next step is a first step, as in plain torch, for the optimizers that make their
state at their first step (Adam, AdamW, SGD with momentum). hivemind then finds tensors in the state and skips its
own step. An optimizer whose state already holds tensors is left as it is.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch

OptimizerFactory = Callable[[Iterable], torch.optim.Optimizer]


def with_fresh_state(factory: OptimizerFactory) -> OptimizerFactory:
    """`factory`, whose optimizers come with their state made (see the module's docstring)."""
    def build(params) -> torch.optim.Optimizer:
        optimizer = factory(params)
        make_fresh_state_(optimizer)
        return optimizer
    return build


@torch.no_grad()
def make_fresh_state_(optimizer: torch.optim.Optimizer) -> None:
    if any(torch.is_tensor(value) for state in optimizer.state.values() for value in state.values()):
        return
    params = [param for group in optimizer.param_groups for param in group["params"]]
    grads, rates = [param.grad for param in params], [group["lr"] for group in optimizer.param_groups]
    try:
        for param in params:
            param.grad = torch.zeros_like(param)
        for group in optimizer.param_groups:
            group["lr"] = 0.0
        optimizer.step()
    finally:
        for param, grad in zip(params, grads):
            param.grad = grad
        for group, rate in zip(optimizer.param_groups, rates):
            group["lr"] = rate
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value):
                value.zero_()
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                state[key] = type(value)(0)
