"""peer/tasks/contract.py: a task that breaks its contract is refused before the peer joins, naming the culprit."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from peer.tasks import Task
from peer.tasks.contract import TaskContractError, check_first_batch, check_task
from tests.tasks_for_tests import SyntheticDataset, _mlp, mse_loss, sgd

CPU = torch.device("cpu")
GOOD = dict(name="mlp", build_model=lambda: _mlp(8, 1), build_train_dataset=lambda: SyntheticDataset(64),
            build_val_dataset=lambda: SyntheticDataset(16), loss_fn=mse_loss, build_optimizer=sgd, batch_size=8)


def check(statistics=(), batch_size=8, powersgd_rank=None, **broken) -> None:
    task = Task(**{**GOOD, **broken})
    model, train = task.build_model(), task.build_train_dataset()
    check_task(task, model, train, task.build_val_dataset(), batch_size, CPU, statistics, powersgd_rank)
    check_first_batch(task, model, train, batch_size, CPU)


def test_a_task_that_keeps_the_contract_passes_and_its_model_is_left_as_built():
    model = nn.Sequential(nn.Linear(32, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 1))
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    task = Task(**{**GOOD, "build_model": lambda: model})
    check_task(task, model, SyntheticDataset(64), SyntheticDataset(16), 8, CPU)
    check_first_batch(task, model, SyntheticDataset(64), 8, CPU)
    assert model.training and all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())


@pytest.mark.parametrize("broken, expected", [
    (dict(build_model=lambda: nn.ReLU()), "build_model() returned a model without trainable parameters"),
    (dict(build_optimizer=lambda params: torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)),
     "build_optimizer(parameters) returned an optimizer over other tensors than the parameters it was given"),
    (dict(build_optimizer=lambda params: (_ for _ in ()).throw(ValueError("no lr"))),
     "build_optimizer(parameters) raised ValueError: no lr"),
    (dict(build_train_dataset=lambda: []), "build_train_dataset() holds 0 samples, fewer than one batch of 8"),
    (dict(build_train_dataset=lambda: SyntheticDataset(5)), "holds 5 samples, fewer than one batch of 8; lower"),
    (dict(build_val_dataset=lambda: []), "build_val_dataset() holds 0 samples, fewer than 1"),
    (dict(loss_fn=lambda model, batch: model(batch[0])), "loss_fn(model, batch) returned (8, 1), not a scalar"),
    (dict(loss_fn=lambda model, batch: torch.tensor(float("nan"))), "loss_fn(model, batch) is nan on the first"),
    (dict(loss_fn=lambda model, batch: exit(0)), "loss_fn(model, batch) called sys.exit(0)"),
])
def test_each_broken_rule_is_named_with_its_function(broken, expected):
    with pytest.raises(TaskContractError) as error:
        check(**broken)
    assert expected in str(error.value) and "\n" not in str(error.value)


def test_an_optimizer_statistic_the_optimizer_does_not_keep_is_named_with_those_it_does():
    adam = dict(build_optimizer=lambda params: torch.optim.Adam(params))
    check(statistics=("exp_avg", "exp_avg_sq"), **adam)
    with pytest.raises(TaskContractError, match=r"--average-opt-statistics nonexistent_stat: not in the state of Adam"
                                                r".*it keeps: exp_avg, exp_avg_sq\)"):
        check(statistics=("exp_avg", "nonexistent_stat"), **adam)


def test_a_powersgd_rank_that_compresses_no_matrix_of_the_model_is_refused_with_the_highest_useful_one():
    # _mlp(8, 1): Linear(32, 8) is the largest matrix; 8 x 32 = 256 elements, halved at rank 256 / 2 / 40 = 3
    check(powersgd_rank=3)
    with pytest.raises(TaskContractError, match=r"--powersgd-rank 4 compresses none of the matrices .* at most 3$"):
        check(powersgd_rank=4)
