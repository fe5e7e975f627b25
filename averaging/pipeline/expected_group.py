"""ExpectedGroup: how many peers an averager's next round waits for, told by the training process.

hivemind's matchmaking closes a group when its leader's window ends, or as soon as `target_group_size` peers have
joined. A round that averages the whole swarm is only whole if every peer at its epoch joins, and they reach the
epoch's end seconds apart (16 peers on 2 cores: up to 24 s). The training process counts the peers it expects
(averaging/strategies/whole_rounds.py) and writes the count here, with the epoch the round leads to; the averager's
process reads it as that round starts looking for a group (averaging/adapter/epoch_keys.py) and makes it the round's
target group size, so its group closes once all of them are in.
"""
from __future__ import annotations

import ctypes
import multiprocessing as mp
from typing import Optional, Sequence

import torch

from averaging.pipeline.round_pipeline import RoundStage

_NONE = -1


class ExpectedGroup(RoundStage):
    """The expected group of the next round, shared between the training process and the averager's process."""

    def __init__(self):
        self._shared = None

    def prepare(self, averaged_tensors: Sequence[torch.Tensor]) -> None:
        self._shared = mp.RawArray(ctypes.c_longlong, [_NONE, _NONE])  # the size, then the epoch it is for

    def expect(self, epoch: int, peers: int) -> None:
        """The round that leads to `epoch` waits for `peers` peers, this one included."""
        # the size first: a reader that sees the new epoch sees its size (the round starts after this returns)
        self._shared[0], self._shared[1] = peers, epoch

    def of_round(self, epoch: Optional[int]) -> Optional[int]:
        """The group size the round that leads to `epoch` waits for (None: none was told, or fewer than two)."""
        if self._shared is None or epoch is None or self._shared[1] != epoch:
            return None
        peers = self._shared[0]
        return peers if peers >= 2 else None
