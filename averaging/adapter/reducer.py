"""Robust reduction inside hivemind's all-reduce: a reducer that screens each sender's part before combining.

hivemind's TensorPartReducer keeps a running sum of the parts it receives. RobustPartReducer keeps each
sender's part instead, combines them with averaging/pipeline/robust.py once every sender's part has arrived
(capping the weights where the averager carries a WeightBound: its weights are sample counts), and after the
round sends a verdict per sender to the training process through the averager's Defence
(averaging/pipeline/defence.py), where exclusion is decided. RobustAllReduceRunner is hivemind's
AllReduceRunner with such a reducer. Both override upstream code that averaging/adapter/upstream.py fingerprints.
"""
from __future__ import annotations

import logging
from typing import Dict, List, Optional, Sequence

import torch
from hivemind.averaging.partition import AllreduceException
from hivemind.p2p import PeerID

from averaging.adapter.grace import GracefulPartReducer
from averaging.adapter.runner import CanonicalAllReduceRunner
from averaging.pipeline.defence import Credit, Defence, Verdict
from averaging.pipeline.robust import Contribution, Drop, Finding, NothingToAggregate, WeightBound, aggregate
from averaging.pipeline.stragglers import GraceWindow

logger = logging.getLogger(__name__)


# --- the reducer ---------------------------------------------------------------------------------


class RobustPartReducer(GracefulPartReducer):
    """hivemind's TensorPartReducer (with the grace window), keeping each sender's part instead of a running sum, so
    that the part can be screened and combined robustly once every sender's contribution has arrived."""

    def __init__(self, part_shapes, sender_peer_ids: Sequence[PeerID], own_peer_id: PeerID, round_id: str,
                 defence: Defence, grace: Optional[GraceWindow] = None, weight_bound: Optional[WeightBound] = None):
        self.sender_peer_ids, self.own_peer_id, self.round_id = list(sender_peer_ids), own_peer_id, round_id
        self.defence, self.weight_bound = defence, weight_bound
        excluded = defence.excluded()
        self.excluded_senders = [index for index, peer in enumerate(self.sender_peer_ids) if peer in excluded]
        # this peer's own contribution, which it trusts (None: it only reduces, as an auxiliary peer)
        self.own_sender = next((index for index, peer in enumerate(self.sender_peer_ids) if peer == own_peer_id), None)
        self.contributions: List[Contribution] = []
        self.offences: Dict[int, Finding] = {}  # sender index -> its first offence (a drop before a weight claim)
        self.participated: set = set()
        self.norm_judged: set = set()  # senders of a part whose norm was judged
        self.fully_judged: set = set()  # senders of a part whose direction was judged too
        self.dropped: set = set()  # senders with a part left out of this round
        self.used_weight: Dict[int, float] = {}  # sender index -> the weight its parts were combined with
        super().__init__(part_shapes, len(self.sender_peer_ids), grace)

    def reset_accumulators(self):
        self.contributions = []
        super().reset_accumulators()

    def take(self, sender_index: int, tensor_part: torch.Tensor, weight: float) -> None:
        self.contributions.append(Contribution(sender_index, tensor_part, weight, self._attributed(sender_index)))
        self.participated.add(sender_index)

    def finish_current_part(self) -> None:
        try:
            result, drops, norm_judged, fully_judged, capped = aggregate(
                self.contributions, self.defence.policy, self.excluded_senders, self.weight_bound, self.own_sender)
        except NothingToAggregate as e:
            self.current_part_future.set_exception(AllreduceException(f"part {self.current_part_index}: {e}"))
            self.finalize()
            return
        for finding in [*drops, *capped]:
            if finding.is_offence:
                self._note(finding)
        self.dropped.update(drop.sender for drop in drops)
        caps = {claim.sender: claim.cap for claim in capped}
        for item in self.contributions:
            self.used_weight[item.sender] = caps.get(item.sender, item.weight)
        if norm_judged:
            self.norm_judged.update(item.sender for item in self.contributions)
        if fully_judged:
            self.fully_judged.update(item.sender for item in self.contributions)
        self.current_part_future.set_result(result)
        self.reset_accumulators()

    def _attributed(self, sender_index: int) -> Optional[float]:
        """The samples the sender's believed progress records account for, where the averager carries them."""
        evidence = self.weight_bound.evidence if self.weight_bound is not None else None
        if evidence is None or sender_index == self.own_sender:
            return None  # this peer's own weight is its own count
        return evidence.attributed(self.sender_peer_ids[sender_index].to_bytes().hex())

    def _note(self, offence: Finding) -> None:
        # one verdict per sender and round: a dropped contribution (what the drop counters count) outranks a
        # capped weight claim in another part
        first = self.offences.get(offence.sender)
        if first is None or (not isinstance(first, Drop) and isinstance(offence, Drop)):
            self.offences[offence.sender] = offence

    def finalize(self):
        if not self.finished.is_set():
            try:
                self.defence.report(self._verdicts())
                self.defence.report_credit(self._credits())
            except (ValueError, OSError):  # the queue is closed: this peer is shutting down
                pass
        super().finalize()

    def _credits(self) -> List[Credit]:
        """What this round's senders contributed, as this reducer accepted it: only where weights are samples."""
        if self.weight_bound is None:
            return []
        return [Credit(self.sender_peer_ids[index].to_base58(), weight)
                for index, weight in sorted(self.used_weight.items())
                if index != self.own_sender and index not in self.dropped and index not in self.excluded_senders
                and weight > 0]

    def _verdicts(self) -> List[Verdict]:
        verdicts = []
        for index in sorted(self.participated):
            peer = self.sender_peer_ids[index]
            if peer == self.own_peer_id or index in self.excluded_senders:
                continue  # a peer never accuses itself; the excluded are already judged
            offence: Optional[Finding] = self.offences.get(index)
            if offence is None and index not in self.norm_judged:
                continue  # no verdict: a round in which no outlier could have been seen (fewer than three senders)
            # a round in which a sign flip could not have been seen (a group of three, or no consensus on a
            # direction) is clean only for the checks that ran (averaging/pipeline/exclusion.py)
            direction_judged = index in self.fully_judged
            if offence is None:
                verdicts.append(Verdict(peer.to_base58(), self.round_id, direction_judged=direction_judged))
                continue
            dropped = isinstance(offence, Drop)
            verdicts.append(Verdict(peer.to_base58(), self.round_id, offence.reason, offence.detail, dropped=dropped,
                                    direction_judged=direction_judged))
            logger.debug(f"{'dropped the contribution' if dropped else 'capped the weight'} of {peer} in round "
                         f"{self.round_id}: {offence.reason} ({offence.detail})")
        return verdicts


class RobustAllReduceRunner(CanonicalAllReduceRunner):
    """hivemind's AllReduceRunner, with canonical replies, and a RobustPartReducer in place of its reducer.

    :param weight_bound: where the averager's weights are sample counts, the cap on each sender's weight
    """

    def __init__(self, *, defence: Defence, weight_bound: Optional[WeightBound] = None, **kwargs):
        self.defence, self.weight_bound = defence, weight_bound
        super().__init__(**kwargs)

    def make_reducer(self, part_shapes, grace: Optional[GraceWindow]) -> RobustPartReducer:
        return RobustPartReducer(part_shapes, self.sender_peer_ids, self.peer_id, self.group_id.hex()[:12],
                                 self.defence, grace, self.weight_bound)
