"""Robust aggregation and exclusion, wired into hivemind's averager processes.

Each hivemind averager is its own process, forked when it starts. A `Defence` is made in the peer's
main process before its averagers fork (see `building`), and each averager it builds carries it:

- the averager's reducers are RobustPartReducers (averaging/pipeline/robust.py decides what is dropped);
- after every round, each reducer sends a verdict per sender (dropped, and why, or not) back to the
  main process through the Defence's queue; there an ExclusionBook (averaging/pipeline/exclusion.py) decides
  who is excluded and writes the excluded peer ids into the Defence's shared memory;
- every averager process reads that list: it refuses excluded peers as followers and as leaders in
  matchmaking, neither serves its state to one nor downloads state from one, and drops what one sends
  in a group that another leader formed with it.

The hivemind patches that call into here are installed by averaging/adapter/hivemind_compat.py.
"""
from __future__ import annotations

import asyncio
import ctypes
import logging
import multiprocessing as mp
import queue
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.partition import AllreduceException, BannedException, TensorPartReducer
from hivemind.p2p import PeerID

from averaging.pipeline.carried import Carried
from averaging.pipeline.robust import Contribution, Drop, NothingToAggregate, RobustPolicy, aggregate

logger = logging.getLogger(__name__)

EXCLUDED_CAPACITY_BYTES = 64 * 1024  # about 1200 base58 peer ids


@dataclass(frozen=True)
class Verdict:
    """What one reducer decided about one sender in one round."""

    peer: str  # base58
    round_id: str
    offence: str = ""  # a Drop reason, or "" when every part it sent was kept and judged by every check
    detail: str = ""


class Defence:
    """The policy, the excluded peers and the verdict queue that a peer's averager processes share."""

    def __init__(self, policy: RobustPolicy):
        self.policy = policy
        self._excluded = mp.Array(ctypes.c_char, EXCLUDED_CAPACITY_BYTES, lock=True)
        self._verdicts = mp.Queue()
        self._cached_raw, self._cached = b"", frozenset()

    def excluded(self) -> frozenset:
        """The excluded peers, as PeerIDs (read from shared memory, parsed once per change)."""
        with self._excluded.get_lock():
            raw = self._excluded.value
        if raw != self._cached_raw:
            names = raw.decode().split()
            self._cached_raw, self._cached = raw, frozenset(PeerID.from_base58(name) for name in names)
        return self._cached

    def set_excluded(self, peers: Sequence[str]) -> None:
        raw = " ".join(peers).encode()
        if len(raw) >= EXCLUDED_CAPACITY_BYTES:
            raise ValueError(f"too many excluded peers to share ({len(peers)})")
        with self._excluded.get_lock():
            self._excluded.value = raw

    def report(self, verdicts: List[Verdict]) -> None:
        for verdict in verdicts:
            self._verdicts.put(verdict)

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
        self._verdicts.close()
        self._verdicts.cancel_join_thread()  # a verdict nobody reads must not hold up this process's exit


# --- which Defence an averager carries ------------------------------------------------------------

defences: Carried[Defence] = Carried("defence")
building = defences.building
active: Optional[Defence] = None
"""In an averager process: the Defence of the averager it runs (one averager per process)."""


def activate_defence(averager) -> None:
    """Called first thing in the averager's own process."""
    global active
    active = defences.of(averager)


def is_excluded(peer_id: PeerID) -> bool:
    return active is not None and peer_id in active.excluded()


# --- the reducer ---------------------------------------------------------------------------------


class RobustPartReducer(TensorPartReducer):
    """hivemind's TensorPartReducer, keeping each sender's part instead of a running sum, so that the
    part can be screened and combined robustly once every sender's contribution has arrived."""

    def __init__(self, part_shapes, sender_peer_ids: Sequence[PeerID], own_peer_id: PeerID, round_id: str,
                 defence: Defence):
        self.sender_peer_ids, self.own_peer_id, self.round_id = list(sender_peer_ids), own_peer_id, round_id
        self.defence = defence
        excluded = defence.excluded()
        self.excluded_senders = [index for index, peer in enumerate(self.sender_peer_ids) if peer in excluded]
        self.contributions: List[Contribution] = []
        self.offences: dict = {}  # sender index -> the first Drop that was an offence
        self.participated: set = set()
        self.fully_judged: set = set()  # senders of a part whose direction was judged
        super().__init__(part_shapes, len(self.sender_peer_ids))

    def reset_accumulators(self):
        self.contributions = []
        super().reset_accumulators()

    async def accumulate_part(self, sender_index: int, part_index: int, tensor_part: torch.Tensor,
                              weight: float = 1.0) -> torch.Tensor:
        # upstream's bookkeeping, with the contribution kept instead of added to the running sum
        assert 0 <= sender_index < self.num_senders, "invalid sender index"
        assert 0 <= part_index < self.num_parts, "invalid part index"
        self.num_parts_received[sender_index] += 1
        while part_index > self.current_part_index:
            finished = asyncio.create_task(self.finished.wait())
            await asyncio.wait({self.current_part_future, finished}, return_when=asyncio.FIRST_COMPLETED)
            finished.cancel()
            if self.finished.is_set():
                raise AllreduceException(f"attempted to aggregate part in a finalized {self.__class__.__name__}")
        if self.sender_failed_after[sender_index] != float("inf"):
            raise BannedException(f"sender {sender_index} was banned in background")
        assert part_index == self.current_part_index
        current_part_future = self.current_part_future
        if part_index < self.sender_failed_after[sender_index]:
            self.contributions.append(Contribution(sender_index, tensor_part, weight))
            self.participated.add(sender_index)
            self.current_part_accumulated_from += 1
            self.check_current_part_finished()
        return await current_part_future

    def check_current_part_finished(self):
        assert self.current_part_accumulated_from <= self.num_current_senders
        if self.current_part_accumulated_from != self.num_current_senders:
            return
        try:
            result, drops, fully_judged = aggregate(self.contributions, self.defence.policy,
                                                        self.excluded_senders)
        except NothingToAggregate as e:
            self.current_part_future.set_exception(AllreduceException(f"part {self.current_part_index}: {e}"))
            self.finalize()
            return
        for drop in drops:
            if drop.is_offence:
                self.offences.setdefault(drop.sender, drop)
        if fully_judged:
            self.fully_judged.update(item.sender for item in self.contributions)
        self.current_part_future.set_result(result)
        self.reset_accumulators()

    def finalize(self):
        if not self.finished.is_set():
            try:
                self.defence.report(self._verdicts())
            except (ValueError, OSError):  # the queue is closed: this peer is shutting down
                pass
        super().finalize()

    def _verdicts(self) -> List[Verdict]:
        verdicts = []
        for index in sorted(self.participated):
            peer = self.sender_peer_ids[index]
            if peer == self.own_peer_id or index in self.excluded_senders:
                continue  # a peer never accuses itself; the excluded are already judged
            drop: Optional[Drop] = self.offences.get(index)
            if drop is None and index not in self.fully_judged:
                # no verdict: a round in which a sign flip could not have been seen (a group of three, or
                # no consensus on a direction) must not count as clean, or such rounds would outnumber an
                # attacker's offences in its exclusion window
                continue
            verdicts.append(Verdict(peer.to_base58(), self.round_id, drop.reason if drop else "",
                                    drop.detail if drop else ""))
            if drop is not None:
                logger.debug(f"dropped the contribution of {peer} to round {self.round_id}: {drop.reason} "
                             f"({drop.detail})")
        return verdicts


class RobustAllReduceRunner(AllReduceRunner):
    """hivemind's AllReduceRunner with a RobustPartReducer in place of its reducer."""

    def __init__(self, *, defence: Defence, **kwargs):
        super().__init__(**kwargs)
        upstream_reducer = self.tensor_part_reducer
        upstream_reducer.finished.set()  # never used: finalizing it would warn that it received nothing
        self.tensor_part_reducer = RobustPartReducer(
            upstream_reducer.part_shapes, self.sender_peer_ids, self.peer_id, self.group_id.hex()[:12], defence
        )
