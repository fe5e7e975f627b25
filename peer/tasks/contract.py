"""The task contract, checked once before a peer joins the swarm.

A task that breaks it used to fail late and badly: an optimizer that ignores the parameters it is given
hung hivemind's state averager, an empty dataset crashed after the averagers had started, an unknown
--average-opt-statistics name hung the first round. Each failure here is one line naming the task
function at fault and the fix (exit 2).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch.utils.data import Dataset, default_collate

from averaging.codecs.compression import max_useful_powersgd_rank
from peer.tasks.base import Task
from peer.tasks.data import move_to
from peer.tasks.registry import TaskLoadError


class TaskContractError(TaskLoadError):
    """The task breaks its contract; the message names the function and the fix."""


def check_task(task: Task, model: torch.nn.Module, train: Dataset, val: Dataset, batch_size: int,
               device: torch.device, opt_statistics: Sequence[str] = (), powersgd_rank: Optional[int] = None) -> None:
    """Everything but the first batch (check_first_batch): the model, the optimizer, the statistics to average, the
    PowerSGD rank and the datasets' sizes.

    :param powersgd_rank: with --averaging powersgd, the rank, which must compress some matrix of the model
    :raises TaskContractError: the first broken rule"""
    where = f"--task {task.name}"
    params = list(model.parameters())
    if not any(param.requires_grad for param in params):
        raise TaskContractError(f"{where}: build_model() returned a model without trainable parameters; "
                                f"return the model to train")
    optimizer = call_task(where, "build_optimizer(parameters)", task.build_optimizer, params)
    owned = {id(param) for group in optimizer.param_groups for param in group["params"]}
    if owned != {id(param) for param in params}:
        raise TaskContractError(f"{where}: build_optimizer(parameters) returned an optimizer over other tensors than "
                                f"the parameters it was given; optimize exactly those (e.g. torch.optim.AdamW(params))")
    _check_statistics(where, task, opt_statistics)
    if powersgd_rank is not None:
        _check_powersgd_rank(where, params, powersgd_rank)
    for kind, dataset, needed in (("train", train, batch_size), ("val", val, 1)):
        size = len(dataset)
        if size < needed:
            raise TaskContractError(f"{where}: build_{kind}_dataset() holds {size} samples, fewer than "
                                    f"{'one batch of ' if needed > 1 else ''}{needed}; "
                                    f"{'lower --batch-size or ' if needed > 1 else ''}give it more data")


def check_first_batch(task: Task, model: torch.nn.Module, train: Dataset, batch_size: int,
                      device: torch.device) -> None:
    """The task's data and loss, on its first batch: the one check that runs the task's own code on samples, and so
    the one a peer times (a dataset that hangs is found here, not as a silent stall later).

    :raises TaskContractError: the loss is not one finite number"""
    where = f"--task {task.name}"
    batch = move_to((task.collate_fn or default_collate)([train[index] for index in range(batch_size)]), device)
    training = model.training
    model.eval()  # no dropout draws, no batch-norm statistics moved: the model is left as it was built
    try:
        with torch.no_grad():
            loss = call_task(where, "loss_fn(model, batch)", task.loss_fn, model, batch)
    finally:
        model.train(training)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise TaskContractError(f"{where}: loss_fn(model, batch) returned {shape}, not a scalar tensor; "
                                f"reduce it to one number (e.g. .mean())")
    if not bool(torch.isfinite(loss)):
        raise TaskContractError(f"{where}: loss_fn(model, batch) is {float(loss)} on the first batch, before any "
                                f"training; check the model's initialization and the loss")


def _check_powersgd_rank(where: str, params: Sequence[torch.Tensor], rank: int) -> None:
    """hivemind compresses a matrix only when the rank is low enough to halve it: a rank too high for every
    matrix of the model would average uncompressed gradients under the name of PowerSGD."""
    useful = max((max_useful_powersgd_rank(param) for param in params if param.ndim > 1), default=0)
    if not useful:
        raise TaskContractError(f"--averaging powersgd: the model of {where} has no matrix to compress; "
                                f"use --averaging sync")
    if rank > useful:
        raise TaskContractError(f"--powersgd-rank {rank} compresses none of the matrices of the model of {where} (a "
                                f"matrix is compressed only when rank x (rows + columns) is at most half its size); "
                                f"choose at most {useful}")


def _check_statistics(where: str, task: Task, names: Sequence[str]) -> None:
    """Names averaged by --average-opt-statistics must be in the optimizer's state (after one step)."""
    if not names:
        return
    probe = torch.nn.Parameter(torch.zeros(1))
    optimizer = call_task(where, "build_optimizer(parameters)", task.build_optimizer, [probe])
    probe.grad = torch.zeros_like(probe)
    optimizer.step()
    known = sorted(key for key, value in optimizer.state[probe].items()  # per-parameter tensors, not a step count
                   if isinstance(value, torch.Tensor) and value.dim() > 0)
    unknown = [name for name in names if name not in known]
    if unknown:
        raise TaskContractError(f"--average-opt-statistics {','.join(unknown)}: not in the state of "
                                f"{type(optimizer).__name__}, the optimizer of {where} (it keeps: "
                                f"{', '.join(known) or 'nothing'}); name some of those, or drop the option")


def call_task(where: str, what: str, function, *args) -> Any:
    """A task function's result; its exception or exit becomes a TaskContractError naming it."""
    try:
        return function(*args)
    except SystemExit as e:
        raise TaskContractError(f"{where}: {what} called sys.exit({e.code!r})") from e
    except Exception as e:
        raise TaskContractError(f"{where}: {what} raised {type(e).__name__}: {e}") from e
