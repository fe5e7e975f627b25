"""The defence stage of the round pipeline: robust reduction, its verdicts, and the peers excluded for them.

A Defence is made in the peer's main process and included in the pipeline of every averager it builds
(averaging/pipeline/round_pipeline.py), so each averager process carries it:

- the averager's reducers screen what each sender contributes (averaging/adapter/reducer.py, with the
  rules of averaging/pipeline/robust.py), and cap the weights of an averager whose weights are sample counts
  (it also carries a robust.WeightBound);
- after every round, each reducer sends a verdict per sender (an offence, and whether its contribution was
  dropped for it, or none) back to the main process through the Defence's queue; there an ExclusionBook
  (averaging/pipeline/exclusion.py) decides who is excluded and writes the excluded peer ids into the
  Defence's shared memory;
- each reducer of an averager whose weights are sample counts also sends what it accepted of each sender in each
  round (its capped weight, unless its contribution was dropped): the Credit that this peer observed of the others,
  which it publishes for `peer status` to set beside each peer's own claim;
- every averager process reads that list: it refuses excluded peers as followers and as leaders in
  matchmaking, neither serves its state to one nor downloads state from one, and drops what one sends
  in a group that another leader formed with it.
"""
from __future__ import annotations

import multiprocessing as mp
import queue
from dataclasses import dataclass
from typing import List, Sequence

from averaging.pipeline.peer_set import SharedPeerSet
from averaging.pipeline.robust import RobustPolicy
from averaging.pipeline.round_pipeline import RoundStage


@dataclass(frozen=True)
class Verdict:
    """What one reducer decided about one sender in one round."""

    peer: str  # base58
    round_id: str
    offence: str = ""  # a Drop or WeightClaim reason, or "" when every part it sent was kept
    detail: str = ""
    dropped: bool = False
    """Whether the offence left its contribution out (a drop, counted as one); False for a clean round, and for an
    offence whose contribution was still used (a weight claim, capped) or that was no contribution (a bad state)."""
    direction_judged: bool = True
    """Whether the direction check ran on the sender's contribution (four or more senders that agree on a direction):
    where it did not, a sign flip would have gone unseen, and the round is clean only for the other checks."""


@dataclass(frozen=True)
class Credit:
    """The samples one reducer accepted from one sender in one round (its weight, after any cap)."""

    peer: str  # base58
    samples: float


class Defence(RoundStage):
    """The policy, the excluded peers and the verdict queue that a peer's averager processes share."""

    def __init__(self, policy: RobustPolicy):
        self.policy = policy
        self._excluded = SharedPeerSet()
        self._verdicts = mp.Queue()
        self._credits = mp.Queue()

    def excluded(self) -> frozenset:
        """The excluded peers, as PeerIDs (read from shared memory, parsed once per change)."""
        return self._excluded.get()

    def set_excluded(self, peers: Sequence[str]) -> None:
        self._excluded.set(peers)

    def refuses(self, peer_id) -> bool:
        return peer_id in self.excluded()

    def report(self, verdicts: List[Verdict]) -> None:
        for verdict in verdicts:
            self._verdicts.put(verdict)

    def report_credit(self, credits: List[Credit]) -> None:
        for credit in credits:
            self._credits.put(credit)

    def take_credits(self) -> List[Credit]:
        """Credits sent since the last call, without waiting."""
        taken = []
        try:
            while True:
                taken.append(self._credits.get_nowait())
        except queue.Empty:
            return taken

    def take_verdicts(self, timeout: float) -> List[Verdict]:
        """Verdicts sent since the last call; waits up to `timeout` seconds for the first one."""
        taken = []
        try:
            taken.append(self._verdicts.get(timeout=timeout))
            while True:
                taken.append(self._verdicts.get_nowait())
        except queue.Empty:
            return taken

    def close(self) -> None:
        for channel in (self._verdicts, self._credits):
            channel.close()
            channel.cancel_join_thread()  # what nobody reads must not hold up this process's exit
