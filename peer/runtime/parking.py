"""A paused peer on a GPU gives the device's memory back: its model and optimizer state wait in host memory.

Moving them is cheaper than dropping them and downloading the swarm's state again: a copy over PCIe
takes a fraction of a second for a model that takes minutes to download, and the peer downloads on
resume anyway if the swarm moved on. Each tensor keeps its identity (its `.data` moves), so the
optimizer, hivemind's averagers and the training loop hold the same objects before and after.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, List, Tuple

import torch


@dataclass
class Parked:
    """Tensors moved to the host, and the device each came from."""

    tensors: List[Tuple[torch.Tensor, torch.device]]
    bytes: int

    def unpark(self) -> None:
        with torch.no_grad():
            for tensor, device in self.tensors:
                tensor.data = tensor.data.to(device)
        self.tensors = []


def park(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Parked:
    """Move every CUDA tensor of the model (parameters, their gradients, buffers) and of the optimizer's state to
    the host, and release the memory they held on the device. Off a GPU, nothing moves."""
    moved, size, seen = [], 0, set()
    with torch.no_grad():
        for tensor in _tensors(model, optimizer):
            if tensor.device.type != "cuda" or id(tensor) in seen:
                continue
            seen.add(id(tensor))
            moved.append((tensor, tensor.device))
            size += tensor.numel() * tensor.element_size()
            tensor.data = tensor.data.to("cpu")
    if moved:
        torch.cuda.empty_cache()  # give the memory back to the driver, not just to torch's cache
    return Parked(moved, size)


def _tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for parameter in model.parameters():
        if parameter.grad is not None:  # before its parameter: a gradient must never be on another device
            yield parameter.grad
        yield parameter
    yield from model.buffers()
    for state in optimizer.state.values():
        yield from (value for value in state.values() if isinstance(value, torch.Tensor))
