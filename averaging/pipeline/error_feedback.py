"""Error feedback for lossy gradient codecs: what a round's codec lost goes into the next round, on both legs.

A round has two lossy legs, and each carries its own loss:

- **Sending.** A peer with error feedback sends x = g + e, its contribution plus the residual e carried
  from its earlier rounds, and keeps e' = x - decoded(x) for each part another peer reduced. The part a
  peer reduces itself never goes through the codec: its residual is consumed whole.
- **Replying.** A reducer encodes each part's average once with the same codec and sends those bytes to
  every member (averaging/adapter/runner.py), so every member decodes the same values and they stay
  equal to the last bit. The reducer encodes a + r, the average plus the reply residual r it carried for
  that stretch of the tensors from the earlier rounds in which it reduced it, and keeps
  r' = (a + r) - decoded(a + r) (DoubleSqueeze's server-side feedback). Every member applies the same
  decoded values, so what the reply lost is owed to the whole swarm alike, and r' pays it back the next
  time this peer reduces that stretch. A stretch the reducer does not reduce this round keeps its r.

The part containers that do this inside hivemind's all-reduce are averaging/adapter/partition.py (sending)
and averaging/adapter/runner.py (replying). Where a round does not deliver a part (a reducer failed, or
the round never started), the peer keeps its own g for that part, as without error feedback, and the
residual that part started with.

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
    message, residual = message_with_feedback(values, residual, codec)
    return codec.extract(message), residual


def message_with_feedback(values: torch.Tensor, residual: torch.Tensor, codec: CompressionBase):
    """(the message that carries values + residual under `codec`, what its receivers will not see of it)."""
    carried = values.detach().float() + residual
    message = codec.compress(carried, CompressionInfo.from_tensor(carried), allow_inplace=False)
    return message, finite(carried - codec.extract(message).float())


class ErrorFeedback(RoundStage):
    """The error feedback stage of the round pipeline (averaging/pipeline/round_pipeline.py): the residuals of one
    averager, shared between the training process and the averager's process: `residuals` of what this peer
    sent, `reply_residuals` of what its replies as a reducer lost."""

    def __init__(self):
        self.residuals: List[torch.Tensor] = []
        self.reply_residuals: List[torch.Tensor] = []
        self.lock = mp.Lock()

    def prepare(self, averaged_tensors: Sequence[torch.Tensor]) -> None:
        """In the training process, before the averager forks: residuals shaped like its averaged tensors."""
        def shared_zeros():
            return [torch.zeros(tensor.shape, dtype=torch.float32).share_memory_() for tensor in averaged_tensors]
        self.residuals, self.reply_residuals = shared_zeros(), shared_zeros()

    def matches(self, tensors: Sequence[torch.Tensor]) -> bool:
        return [tuple(t.shape) for t in tensors] == [tuple(r.shape) for r in self.residuals]

    def _all(self) -> List[torch.Tensor]:
        return [*self.residuals, *self.reply_residuals]

    def state_dict(self) -> List[torch.Tensor]:
        """The sending residuals, then the reply residuals."""
        with self.lock:
            return [residual.clone() for residual in self._all()]

    def load_state_dict(self, saved: Optional[Sequence[torch.Tensor]]) -> None:
        """Residuals from a checkpoint; none, or ones of another shape, start from zero. A checkpoint from before
        replies had residuals holds the sending ones alone: the reply residuals start from zero."""
        own = self._all()
        if saved is not None and len(saved) == len(self.residuals):
            saved = [*saved, *(torch.zeros_like(residual) for residual in self.reply_residuals)]
        if saved is None or [tuple(t.shape) for t in saved] != [tuple(r.shape) for r in own]:
            self.reset()
            return
        with self.lock:
            for residual, value in zip(own, saved):
                residual.copy_(finite(value.to(torch.float32)))

    def reset(self) -> None:
        """After a state download: the residuals belonged to the state this peer left."""
        with self.lock:
            for residual in self._all():
                residual.zero_()

    def norm(self) -> float:
        """The norm of the sending residuals (what this peer still owes the swarm of its own contributions)."""
        with self.lock:
            return float(sum(residual.square().sum() for residual in self.residuals) ** 0.5) if self.residuals else 0.0

    def reply_norm(self) -> float:
        """The norm of the reply residuals (what the averages this peer reduced still owe the swarm)."""
        with self.lock:
            return float(sum(r.square().sum() for r in self.reply_residuals) ** 0.5) if self.reply_residuals else 0.0
