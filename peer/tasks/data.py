"""Data plumbing for the training loop: loaders with workers, device moves.

On CUDA, loaders put batches in pinned (page-locked) host memory and the copy to the device is
non-blocking, so it overlaps with the work queued before it; the loop's `h2d` phase stays honest because
the loop synchronizes after it when it times the phases (peer/runtime/trainer.py)."""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Optional

import torch
from torch.utils.data import DataLoader, Dataset, Sampler


def make_loader(
    dataset: Dataset,
    *,
    batch_size: int,
    workers: int,
    order: Optional[Sampler] = None,
    collate_fn: Optional[Callable] = None,
    pin_memory: bool = False,
) -> DataLoader:
    """:param order: the training data's order (peer/tasks/order.py), endless; None: once through, in order, as
        validation reads it"""
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=order,
        num_workers=workers,
        persistent_workers=workers > 0,
        prefetch_factor=4 if workers > 0 else None,
        collate_fn=collate_fn,
        pin_memory=pin_memory,
    )


def move_to(batch: Any, device: torch.device) -> Any:
    """Move tensors inside nested tuples, lists and dicts to the device."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to(item, device) for item in batch)
    if isinstance(batch, dict):
        return {key: move_to(value, device) for key, value in batch.items()}
    return batch


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, loader: DataLoader, loss_fn: Callable, device: torch.device, max_batches: int,
    autocast: Callable[[], ContextManager] = nullcontext,
) -> float:
    """Mean loss over up to max_batches validation batches."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for index, batch in enumerate(loader):
            if index >= max_batches:
                break
            with autocast():
                total += float(loss_fn(model, move_to(batch, device)))
            count += 1
    finally:
        model.train(was_training)
    if count == 0:
        raise ValueError("the validation dataset yields no batch; it must hold at least one sample")
    return total / count
