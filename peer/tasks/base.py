"""The task interface: what a peer trains.

A task is plain data: factories for the model, the datasets and the optimizer, plus a
loss function. The training loop owns devices, data loaders and the swarm; a task must
not start processes, read the peer's config or talk to the network.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional

import torch
from torch.utils.data import Dataset

ModelFactory = Callable[[], torch.nn.Module]
DatasetFactory = Callable[[], Dataset]
LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]
OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]
ModelExporter = Callable[[torch.nn.Module, Path], None]


@dataclass(frozen=True, kw_only=True)
class Task:
    """Everything the peer needs to train one model.

    Every peer of a run must build the same task: the peer seeds the model factory from
    the run id, so that all peers start from identical weights.
    """

    name: str
    """Short name shown in logs, metrics and summaries."""
    build_model: ModelFactory
    """Returns a fresh model on the CPU; the peer moves it to its device."""
    build_train_dataset: DatasetFactory
    """Returns the training dataset (map-style); it is read through a DataLoader with workers."""
    build_val_dataset: DatasetFactory
    """Returns the held-out validation dataset, never trained on."""
    loss_fn: LossFn
    """loss_fn(model, batch) -> scalar loss; the batch is already on the model's device."""
    build_optimizer: OptimizerFactory
    """build_optimizer(parameters) -> torch optimizer, tuned for the global target batch."""
    build_scheduler: Optional[SchedulerFactory] = None
    """Optional build_scheduler(optimizer) -> LR scheduler, stepped once per global epoch."""
    batch_size: int = 32
    """Samples per local step, unless --batch-size overrides it."""
    collate_fn: Optional[Callable[[list], Any]] = None
    """Optional DataLoader collate function; the default stacks tensors."""
    export_model: Optional[ModelExporter] = None
    """Optional export_model(model, directory): writes the trained model into an empty directory in a form other
    tools load (hf-causal-lm: what `from_pretrained` reads). None: `peer export` writes model.safetensors and a
    JSON description."""
    shared_digests: Mapping[str, str] = field(default_factory=dict)
    """Digests of what every peer of the run must share beyond the model's parameter layout, by the command-line
    name of the option that sets it (hf-causal-lm: model_config, tokenizer). They go into the run manifest, and a
    peer whose digests differ from the swarm's is refused, naming the option."""

    def __post_init__(self) -> None:
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"task {self.name!r}: batch_size must be a positive integer (got {self.batch_size!r})")
        for field_name in ("build_model", "build_train_dataset", "build_val_dataset", "loss_fn", "build_optimizer"):
            if not callable(getattr(self, field_name)):
                raise ValueError(f"task {self.name!r}: {field_name} must be callable")
