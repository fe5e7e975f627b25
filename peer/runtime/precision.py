"""Mixed precision for the training loop: autocast for the forward and loss, a loss scaler for fp16.

Master weights, optimizer state and averaging stay fp32: the model's parameters are never cast, only the
operations inside autocast run in bf16 or fp16. fp16 gradients can overflow, so with fp16 each local batch's
loss is scaled before backward, and its gradients are unscaled and checked *before* the swarm optimizer
accumulates them (torch's GradScaler, stepping a one-batch view of the model's parameters):

- a batch whose gradients overflowed is skipped before the swarm optimizer sees it, so its samples are
  never counted toward the target batch and epochs cannot drift apart;
- what the swarm accumulates and averages is always unscaled fp32, so peers with different scales (or
  other precisions) average the same quantity, and the scale never leaves this peer.

hivemind ships its own GradScaler, but it is made for `reuse_grad_buffers=True`, where the scale lives on
through accumulation; our optimizers accumulate in their own buffers, where hivemind's documentation says to
use torch's AMP as is.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, ContextManager, Iterable, Optional

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class _OneBatch:
    """What the loss scaler steps: the model's parameters (their .grad hold one batch) and a step that hands
    the batch to the swarm optimizer. GradScaler calls `step` only when every gradient is finite."""

    def __init__(self, params: Iterable[torch.Tensor]):
        self.param_groups = [{"params": [param for param in params if param.requires_grad]}]
        self.hand_over: Callable[[], None] = lambda: None

    def step(self) -> bool:
        self.hand_over()
        return True


class MixedPrecision:
    def __init__(self, precision: str, device: torch.device, params: Iterable[torch.Tensor],
                 init_scale: float = 2.0 ** 16):
        self.precision, self.device = precision, device
        self.dtype: Optional[torch.dtype] = DTYPES.get(precision)
        self.scaler = torch.amp.GradScaler(device.type, init_scale=init_scale, enabled=precision == "fp16")
        self._batch = _OneBatch(params)

    def autocast(self) -> ContextManager:
        """Around the forward and the loss (training and validation)."""
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def step(self, hand_over: Callable[[], None]) -> bool:
        """Unscale this batch's gradients; if they are finite, call `hand_over` (the swarm optimizer's step).

        :returns: False if the batch overflowed and was skipped (the scale is then lowered for the next one)
        """
        if not self.scaler.is_enabled():
            hand_over()
            return True
        self._batch.hand_over = hand_over
        stepped = self.scaler.step(self._batch) is not None
        self.scaler.update()
        return stepped

    @property
    def scale(self) -> float:
        return float(self.scaler.get_scale()) if self.scaler.is_enabled() else 1.0

    def state_dict(self) -> dict:
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if state and self.scaler.is_enabled():
            self.scaler.load_state_dict(state)
