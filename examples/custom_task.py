"""An external task: a small MLP that learns to tell two interleaved spirals apart.

This is the template for bringing your own model to a swarm. Put a function that returns
a `peer.tasks.Task` in any importable module and name it on the command line:

    peer --task examples.custom_task:make_task      # from the repository root
    PYTHONPATH=examples peer --task custom_task:make_task

Every peer of a run must build the identical task, so the data here is generated from a
fixed seed rather than downloaded: nothing depends on the machine it runs on.

The Task fields, in brief:

- name: a short label for logs, metrics and summaries.
- build_model: returns a fresh model on the CPU. The peer seeds torch from the run id before
  calling it, so initialise weights only through torch's random number generator.
- build_train_dataset: returns a map-style Dataset. It is read through a DataLoader with
  worker processes, so it must be picklable; keep its state in a few tensors or arrays.
- build_val_dataset: returns the held-out Dataset used for the validation loss; never trained on.
- loss_fn(model, batch): returns a scalar loss; `batch` is what the DataLoader yields, already
  moved to the model's device.
- build_optimizer(params): returns a torch optimizer. Pass `params` straight through: it may be
  a list of parameter groups that the swarm optimizer expects to find unchanged.
- build_scheduler(optimizer): optional; returns an LR scheduler stepped once per global epoch.
- batch_size: samples per local step, unless --batch-size overrides it.
- collate_fn: optional DataLoader collate function; the default stacks tensors.

Keep the factories module-level functions (or functools.partial of them), not lambdas, so
that the task can be pickled.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from peer.tasks import Task

DATA_SEED = 1234
"""Fixed, so that every peer generates the same points."""
TRAIN_POINTS = 2048
VAL_POINTS = 512
NOISE = 0.05
"""Standard deviation of the Gaussian jitter added to each point."""


def two_spirals(n_points: int, generator: torch.Generator) -> TensorDataset:
    """Points of two spirals, (x: float32 of shape (2,), label: int64 in {0, 1}), in random order."""
    labels = torch.randint(0, 2, (n_points,), generator=generator)
    # sqrt spreads points evenly along the arm instead of bunching them at the centre.
    radius = torch.sqrt(torch.rand(n_points, generator=generator))
    angle = radius * 3 * math.pi + labels * math.pi
    points = torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], dim=1)
    points = points + NOISE * torch.randn(n_points, 2, generator=generator)
    return TensorDataset(points.float(), labels.long())


def _split(name: str) -> TensorDataset:
    # One stream of points cut in two: the validation points are drawn after, and apart from,
    # the training points.
    generator = torch.Generator().manual_seed(DATA_SEED)
    train = two_spirals(TRAIN_POINTS, generator)
    return train if name == "train" else two_spirals(VAL_POINTS, generator)


def build_train_dataset() -> TensorDataset:
    return _split("train")


def build_val_dataset() -> TensorDataset:
    return _split("val")


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(2, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2))


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    points, labels = batch
    return F.cross_entropy(model(points), labels)


def build_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=1e-4)


def make_task() -> Task:
    return Task(
        name="two-spirals",
        build_model=build_model,
        build_train_dataset=build_train_dataset,
        build_val_dataset=build_val_dataset,
        loss_fn=loss_fn,
        build_optimizer=build_optimizer,
        batch_size=64,
    )
