"""Error feedback for lossy gradient codecs: what a round's codec lost goes into the next round.

A peer with error feedback sends x = g + e, its contribution plus the residual e carried from its
earlier rounds, and keeps e' = x - decoded(x) for each part another peer reduced. hivemind's reducer
replies to each sender with average - decoded(what it sent); adding that reply to decoded(x), not
to x, leaves every peer with the same average, and the loss is carried instead of applied at once
(averaging/codecs/lowbit.py's codecs reply in dense fp16, so peers agree to fp16 precision). The part a
peer reduces itself never goes through the codec: its residual is consumed whole.

Where a round does not deliver a part (a reducer failed, or the round never started), the peer keeps
its own g for that part, as without error feedback, and the residual that part started with.

The residuals live in shared host memory, allocated before the averager forks (as its averaged
tensors are), so that the training process can checkpoint and reset them; a lock keeps those reads
and the averager's writes apart. Residuals never hold NaN or Inf: a non-finite value is dropped.
"""
from __future__ import annotations

import multiprocessing as mp
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from hivemind.averaging.partition import TensorPartContainer
from hivemind.compression import CompressionBase, CompressionInfo

from averaging.pipeline.carried import Carried


def finite(tensor: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(tensor), tensor, torch.zeros((), dtype=tensor.dtype))


def encode_with_feedback(values: torch.Tensor, residual: torch.Tensor, codec: CompressionBase,
                         ) -> Tuple[torch.Tensor, torch.Tensor]:
    """One round for one tensor, outside any swarm: (what the receiver decodes, the next residual)."""
    carried = values + residual
    message = codec.compress(carried, CompressionInfo.from_tensor(carried))
    decoded = codec.extract(message)
    return decoded, finite(carried - decoded)


class ErrorFeedback:
    """The residuals of one averager, shared between the training process and the averager's process."""

    def __init__(self):
        self.residuals: List[torch.Tensor] = []
        self.lock = mp.Lock()

    def allocate_like(self, tensors: Sequence[torch.Tensor]) -> None:
        """In the training process, before the averager forks."""
        self.residuals = [torch.zeros(tensor.shape, dtype=torch.float32).share_memory_() for tensor in tensors]

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


# --- attaching one to an averager before it forks ---------------------------------------------

feedbacks: Carried[ErrorFeedback] = Carried("error_feedback")
building = feedbacks.building
of = feedbacks.of


def carry(averager) -> None:
    """Called as an averager starts, in the training process (its averaged tensors exist by then)."""
    feedback = feedbacks.attach(averager)
    if feedback is not None:
        feedback.allocate_like(averager._averaged_tensors)


# --- inside the all-reduce --------------------------------------------------------------------


class FeedbackPartContainer(TensorPartContainer):
    """hivemind's TensorPartContainer over x = g + e, which turns each reply into a delta to the average,
    and keeps the residual of each part: x - decoded(x) where another peer reduced it, zero where this
    peer did, the old one where the round failed to deliver it.

    :param carried: the residuals the round starts with, one per tensor (already added into `tensors`)
    """

    def __init__(self, tensors: Sequence[torch.Tensor], peer_fractions, carried: Sequence[torch.Tensor],
                 own_index: int, compression: CompressionBase, **kwargs):
        self.own_index = own_index
        self._sent_residuals: Dict[int, torch.Tensor] = {}  # data_ptr of a part -> its residual
        super().__init__(tensors, peer_fractions, compression=_Recording(compression, self._sent_residuals),
                         return_deltas=True, **kwargs)
        self.carried = [residual.view(-1) for residual in carried]
        self.kept = [residual.clone() for residual in carried]  # a part left undelivered keeps its residual
        self._extents = [(tensor.data_ptr(), tensor.element_size(), tensor.numel()) for tensor in tensors]

    def _slices(self, part: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(the carried residual, the kept residual) where `part` lies in the tensors."""
        pointer = part.data_ptr()
        for index, (base, size, numel) in enumerate(self._extents):
            if base <= pointer < base + size * numel:
                start, stop = (pointer - base) // size, (pointer - base) // size + part.numel()
                return self.carried[index][start:stop], self.kept[index].view(-1)[start:stop]
        raise ValueError("a part outside the tensors being averaged")

    def register_processed_part(self, peer_index: int, part_index: int, part: torch.Tensor):
        sent = self._input_parts_by_peer[peer_index][part_index][0]
        _, kept = self._slices(sent)
        if peer_index == self.own_index:
            kept.zero_()
        else:
            residual = self._sent_residuals.pop(sent.data_ptr())
            kept.copy_(residual)
            part = part - residual.to(part.dtype)  # x + reply - residual = the average of the decoded
        super().register_processed_part(peer_index, part_index, part)

    def register_failed_reducer(self, peer_index: int):
        # upstream's, with this peer's g (not x) kept for the parts that will not come back
        for part_index in range(self._outputs_registered_by_peer[peer_index], self.num_parts_by_peer[peer_index]):
            sent = self._input_parts_by_peer[peer_index][part_index][0]
            carried, _ = self._slices(sent)
            TensorPartContainer.register_processed_part(self, peer_index, part_index, -carried.to(sent.dtype))
            self.failed_size += sent.numel()


class _Recording(CompressionBase):
    """A codec that records, for each part it encodes, what the receiver will not see of it."""

    def __init__(self, codec: CompressionBase, residuals: Dict[int, torch.Tensor]):
        self.codec, self.residuals = codec, residuals

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False):
        message = self.codec.compress(tensor, info, allow_inplace=False)
        self.residuals[tensor.data_ptr()] = finite(tensor.detach().float() - self.codec.extract(message).float())
        return message

    def extract(self, serialized_tensor):
        return self.codec.extract(serialized_tensor)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return self.codec.estimate_compression_ratio(info)
