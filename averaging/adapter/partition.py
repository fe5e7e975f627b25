"""Error feedback inside hivemind's all-reduce: a part container over x = g + e that carries what the codec lost.

The residual store and its rules are averaging/pipeline/error_feedback.py; this is the hivemind side, a
TensorPartContainer subclass that overrides upstream code averaging/adapter/upstream.py fingerprints.
"""
from __future__ import annotations

from typing import Dict, Sequence, Tuple

import torch
from hivemind.averaging.partition import TensorPartContainer
from hivemind.compression import CompressionBase, CompressionInfo

from averaging.pipeline.error_feedback import finite


class FeedbackPartContainer(TensorPartContainer):
    """hivemind's TensorPartContainer over x = g + e, whose output is the average (the canonical replies of
    averaging/adapter/runner.py) and which keeps the residual of each part: x - decoded(x) where another peer
    reduced it, zero where this peer did, the old one where the round failed to deliver it (where the
    output is this peer's own g).

    :param carried: the residuals the round starts with, one per tensor (already added into `tensors`)
    """

    def __init__(self, tensors: Sequence[torch.Tensor], peer_fractions, carried: Sequence[torch.Tensor],
                 own_index: int, compression: CompressionBase, **kwargs):
        self.own_index = own_index
        self._sent_residuals: Dict[int, torch.Tensor] = {}  # data_ptr of a part -> its residual
        super().__init__(tensors, peer_fractions, compression=_Recording(compression, self._sent_residuals),
                         return_deltas=False, **kwargs)
        self.carried = [residual.view(-1) for residual in carried]
        self.kept = [residual.clone() for residual in carried]  # a part left undelivered keeps its residual
        self._locate = PartLocator(tensors)

    def _slices(self, part: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(the carried residual, the kept residual) where `part` lies in the tensors."""
        index, where = self._locate(part)
        return self.carried[index][where], self.kept[index].view(-1)[where]

    def register_processed_part(self, peer_index: int, part_index: int, part: torch.Tensor):
        sent = self._input_parts_by_peer[peer_index][part_index][0]
        _, kept = self._slices(sent)
        if peer_index == self.own_index:
            kept.zero_()
        else:
            kept.copy_(self._sent_residuals.pop(sent.data_ptr()))
        super().register_processed_part(peer_index, part_index, part)

    def register_failed_reducer(self, peer_index: int):
        # upstream's, with this peer's g = x - e (not x) kept for the parts that will not come back
        for part_index in range(self._outputs_registered_by_peer[peer_index], self.num_parts_by_peer[peer_index]):
            sent = self._input_parts_by_peer[peer_index][part_index][0]
            carried, _ = self._slices(sent)
            TensorPartContainer.register_processed_part(self, peer_index, part_index, sent - carried.to(sent.dtype))
            self.failed_size += sent.numel()


class PartLocator:
    """Where a part (a view of one of the tensors, as hivemind's container cuts them) lies: (tensor index, slice
    of its flattened values)."""

    def __init__(self, tensors: Sequence[torch.Tensor]):
        self._extents = [(tensor.data_ptr(), tensor.element_size(), tensor.numel()) for tensor in tensors]

    def __call__(self, part: torch.Tensor) -> Tuple[int, slice]:
        pointer = part.data_ptr()
        for index, (base, size, numel) in enumerate(self._extents):
            if base <= pointer < base + size * numel:
                start = (pointer - base) // size
                return index, slice(start, start + part.numel())
        raise ValueError("a part outside the tensors being averaged")


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
