"""StrategyParts: what averaging/strategies/factory.py prepares for every strategy's builder.

A builder (named in averaging/registry.py) is called as builder(config, replica, parts) and owns
`parts.rounds` from then on: its optimizer closes it on shutdown.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from averaging.pipeline.error_feedback import ErrorFeedback
from averaging.pipeline.robust import WeightBound
from averaging.strategies.agreement import StateAgreement
from averaging.strategies.rounds import RoundKeeper


@dataclass
class StrategyParts:
    rounds: RoundKeeper
    """The round bookkeeping: outcomes, resyncs, deadlines and the exclusion watch."""
    tracker_opts: dict
    """ProgressTracker options (how long a peer's records outlive it; tests add each peer's private_key)."""
    averager_opts: dict
    """Options every averager takes (hivemind's request timeout)."""
    matchmaking_floor: float
    """The shortest matchmaking window, fixed in the averager processes at start."""
    allreduce_timeout: float
    """The longest all-reduce, fixed in the averager processes at start."""
    error_feedback: Optional[ErrorFeedback] = None
    """Carries the gradient codec's loss between rounds, where the config asks for it."""
    weight_bound: Optional[WeightBound] = None
    """Caps each sender's weight at a fair share of the target batch: include it around the averagers whose weights
    are sample counts (gradients, pseudo-gradients), and no other (parameter rounds weigh each peer 1)."""
    agreement: Optional[StateAgreement] = None
    """State digests, where the strategy's peers end each epoch with one state (its builder starts it)."""


def next_chunk_timeout(matchmaking_floor: float, allreduce_timeout: float) -> float:
    """How long a peer waits for the next part of an all-reduce or of a state download.

    Upstream waits one matchmaking window for a peer's next chunk, then averages without it: a peer on a busy CPU
    then silently keeps its own values for part of the model and drifts from the swarm (seen: "received 75% of
    input tensors" with a 1 s window). A quarter of the round's timeout still drops a stalled peer well within the
    round."""
    return max(matchmaking_floor, allreduce_timeout / 4)
