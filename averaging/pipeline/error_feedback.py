"""Error feedback for lossy gradient codecs: what a round's codec lost goes into the next round.

A peer with error feedback sends x = g + e, its contribution plus the residual e carried from its
earlier rounds, and keeps e' = x - decoded(x) for each part another peer reduced. hivemind's reducer
replies to each sender with average - decoded(what it sent); adding that reply to decoded(x), not
to x, leaves every peer with the same average, and the loss is carried instead of applied at once
(averaging/codecs/lowbit.py's codecs reply in dense fp16, so peers agree to fp16 precision; the part container
that does this inside hivemind's all-reduce is averaging/adapter/partition.py). The part a
peer reduces itself never goes through the codec: its residual is consumed whole.

Where a round does not deliver a part (a reducer failed, or the round never started), the peer keeps
its own g for that part, as without error feedback, and the residual that part started with.

The residuals live in shared host memory, allocated before the averager forks (as its averaged
tensors are), so that the training process can checkpoint and reset them; a lock keeps those reads
and the averager's writes apart. Residuals never hold NaN or Inf: a non-finite value is dropped.
"""
from __future__ import annotations

import multiprocessing as mp
from typing import List, Optional, Sequence, Tuple

import torch
from hivemind.compression import CompressionBase, CompressionInfo

from averaging.pipeline.round_pipeline import RoundStage


def finite(tensor: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(tensor), tensor, torch.zeros((), dtype=tensor.dtype))


def encode_with_feedback(values: torch.Tensor, residual: torch.Tensor, codec: CompressionBase,
                         ) -> Tuple[torch.Tensor, torch.Tensor]:
    """One round for one tensor, outside any swarm: (what the receiver decodes, the next residual)."""
    carried = values + residual
    message = codec.compress(carried, CompressionInfo.from_tensor(carried))
    decoded = codec.extract(message)
    return decoded, finite(carried - decoded)


class ErrorFeedback(RoundStage):
    """The error feedback stage of the round pipeline (averaging/pipeline/round_pipeline.py): the residuals of one
    averager, shared between the training process and the averager's process."""

    def __init__(self):
        self.residuals: List[torch.Tensor] = []
        self.lock = mp.Lock()

    def prepare(self, averaged_tensors: Sequence[torch.Tensor]) -> None:
        """In the training process, before the averager forks: residuals shaped like its averaged tensors."""
        self.residuals = [torch.zeros(tensor.shape, dtype=torch.float32).share_memory_() for tensor in averaged_tensors]

    def matches(self, tensors: Sequence[torch.Tensor]) -> bool:
        return [tuple(t.shape) for t in tensors] == [tuple(r.shape) for r in self.residuals]

    def state_dict(self) -> List[torch.Tensor]:
        with self.lock:
            return [residual.clone() for residual in self.residuals]

    def load_state_dict(self, saved: Optional[Sequence[torch.Tensor]]) -> None:
        """Residuals from a checkpoint; none, or ones of another shape, start from zero."""
        if saved is None or [tuple(t.shape) for t in saved] != [tuple(r.shape) for r in self.residuals]:
            self.reset()
            return
        with self.lock:
            for residual, value in zip(self.residuals, saved):
                residual.copy_(finite(value.to(torch.float32)))

    def reset(self) -> None:
        """After a state download: the residuals belonged to the state this peer left."""
        with self.lock:
            for residual in self.residuals:
                residual.zero_()

    def norm(self) -> float:
        with self.lock:
            return float(sum(residual.square().sum() for residual in self.residuals) ** 0.5) if self.residuals else 0.0
