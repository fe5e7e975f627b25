"""The round pipeline: the stages a contribution goes through in one averager's all-reduce, in one place.

In order, for each round of an averager:

1. error feedback (error_feedback.ErrorFeedback): this peer sends its tensors plus the residuals that a lossy
   codec left out of earlier rounds, and keeps what this round's codec loses;
2. codec: the averager's own compression (averaging/codecs/) encodes each part on the wire;
3. robust reduction (defence.Defence): where this peer reduces a part, each sender's contribution is screened
   and combined robustly (robust.py), its verdicts go to exclusion (exclusion.py), and excluded peers are
   refused in matchmaking and state sharing; in an averager whose weights are sample counts, the weight bound
   (robust.WeightBound) caps each sender's weight at a fair share of the target batch;
4. the grace window (stragglers.GraceWindow): where this peer reduces a part, it waits for the last senders only so
   long after a quorum of them delivered; a latecomer is left out and still receives the average;
5. completeness (completeness.Completeness): the share of the average that never reached this peer, and of its
   contribution that reducers left out as late, is recorded, so that the training process can tell a partial
   round from a whole one, and a slow peer that it is slow;
6. the state digest (donors.DonorFilter): a state download skips the donors whose state is not the swarm's
   (averaging/swarm/digests.py).

A stage is a small object with the hooks it needs (RoundStage); a RoundPipeline is the ordered tuple of the
stages one averager carries. hivemind starts an averager's process from its constructor, so nothing can be
passed to it: the builder includes stages with `including(stage)` blocks around the averagers it builds, and
the adapter's pre-fork hook (averaging/adapter/allreduce.py) attaches the pipeline to each averager as it
starts, which its process inherits. The adapter's all-reduce drives the stages; nothing here touches hivemind.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import FrozenSet, Iterator, List, Optional, Sequence, Tuple, Type, TypeVar

import torch

S = TypeVar("S", bound="RoundStage")
_ATTRIBUTE = "_swarmtrain_round_pipeline"


@dataclass(frozen=True)
class RoundEnd:
    """What an averager's process learned from one all-reduce (sizes in tensor elements)."""

    group_id: bytes
    failed_size: int
    """Of `total_size`, what never arrived (this peer kept its own values there)."""
    total_size: int
    left_out_size: int = 0
    """Of this peer's contribution, what reducers left out because it came after their grace window."""
    late_reducers: FrozenSet[str] = frozenset()
    """Reducers (base58 ids) whose replies reached this peer after the grace window (stragglers.py)."""
    judged_slow: bool = False
    """Its group found this peer late as a reducer and gave it nothing to reduce."""


class RoundStage:
    """One step of what happens to a contribution in a round; every hook is optional."""

    def prepare(self, averaged_tensors: Sequence[torch.Tensor]) -> None:
        """In the training process, as the averager starts and before it forks (shared memory goes here)."""

    def refuses(self, peer_id) -> bool:
        """Whether this averager must neither average with `peer_id` nor share state with it."""
        return False

    def refuses_donor(self, peer_id) -> bool:
        """Whether this averager must not download state from `peer_id` now (it may still average with it)."""
        return False

    def finish(self, end: "RoundEnd") -> None:
        """In the averager's process, after each all-reduce."""


class RoundPipeline:
    """The stages of one averager's rounds. The adapter's all-reduce applies each kind at its point of the round
    (the order of the module docstring), so the order they were included in does not matter."""

    def __init__(self, stages: Sequence[RoundStage] = ()):
        self.stages: Tuple[RoundStage, ...] = tuple(stages)

    def stage(self, kind: Type[S]) -> Optional[S]:
        """The stage of this kind, if the averager carries one."""
        return next((stage for stage in self.stages if isinstance(stage, kind)), None)

    def prepare(self, averaged_tensors: Sequence[torch.Tensor]) -> None:
        for stage in self.stages:
            stage.prepare(averaged_tensors)

    def refuses(self, peer_id) -> bool:
        return any(stage.refuses(peer_id) for stage in self.stages)

    def refuses_donor(self, peer_id) -> bool:
        return any(stage.refuses(peer_id) or stage.refuses_donor(peer_id) for stage in self.stages)

    def finish(self, end: "RoundEnd") -> None:
        for stage in self.stages:
            stage.finish(end)


EMPTY = RoundPipeline()
_included: List[RoundStage] = []  # the stages of the `including` blocks open in the training process
_running: Optional[RoundPipeline] = None  # in an averager's process: the pipeline of the averager it runs


@contextlib.contextmanager
def including(stage: Optional[RoundStage]) -> Iterator[None]:
    """Averagers started inside this block carry `stage` (None: nothing), after those of enclosing blocks."""
    if stage is None:
        yield
        return
    _included.append(stage)
    try:
        yield
    finally:
        _included.remove(stage)


def attach(averager, averaged_tensors: Sequence[torch.Tensor], always: Sequence[RoundStage] = ()) -> RoundPipeline:
    """As an averager starts, in the training process: the included stages and `always` become its pipeline."""
    pipeline = RoundPipeline([*_included, *always])
    pipeline.prepare(averaged_tensors)
    setattr(averager, _ATTRIBUTE, pipeline)
    return pipeline


def of(averager) -> RoundPipeline:
    """The pipeline an averager carries (an empty one for an averager built before the adapter was installed)."""
    return getattr(averager, _ATTRIBUTE, EMPTY)


def run_here(averager) -> None:
    """First thing in the averager's own process (one averager per process): its pipeline is this process's."""
    global _running
    _running = of(averager)


def running() -> RoundPipeline:
    """In an averager's process, for hivemind code that has no averager at hand (matchmaking, stubs)."""
    return _running or EMPTY
