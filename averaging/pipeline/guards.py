"""Guards against poisoned updates: nothing non-finite enters a round or a model.

A peer whose own gradients hold NaN or Inf drops that batch instead of contributing it;
an averaged result (gradients, pseudo-gradients or parameters) that holds NaN or Inf is
discarded instead of applied. One buggy or malicious peer can then spoil rounds, but
never the other peers' weights.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch


def all_finite(tensors: Iterable[Optional[torch.Tensor]]) -> bool:
    """True when no tensor holds NaN or Inf (missing gradients count as finite)."""
    with torch.no_grad():
        return all(tensor is None or bool(torch.isfinite(tensor).all()) for tensor in tensors)
