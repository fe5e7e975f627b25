"""The grace window inside hivemind's all-reduce (the rules: averaging/pipeline/stragglers.py).

- GracefulPartReducer: hivemind's TensorPartReducer, which once a quorum of senders has delivered the current
  part waits for the rest only up to the grace window, then leaves the latecomers out of the part and the rest of
  the round. A latecomer is not a failed sender: when its parts arrive, it receives each part's average (the one
  its group holds), instead of nothing. RobustPartReducer (reducer.py) builds on it.
- A runner whose own round is over keeps serving its latecomers (`keep_for_latecomers`) until each has received
  every part's average, or for an all-reduce timeout at most: upstream forgets a group as soon as its round ends and
  answers its late senders' first message with an error, which would leave a slow peer with its own values for that
  part, apart from its group.
- Load balancing reads the bandwidth every member declared as a claim (averaging/pipeline/stragglers.py): a member
  that more than half of the others found late as a reducer gets no part, and a group never ends up with no
  reducer at all (all of them standing aside).

Overrides upstream code that averaging/adapter/upstream.py fingerprints.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator, Dict, Optional, Sequence, Set

import torch
from hivemind.averaging import averager as averager_module
from hivemind.averaging.averager import DecentralizedAverager
from hivemind.averaging.partition import AllreduceException, BannedException, TensorPartReducer
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import achain, anext, as_aiter

from averaging.pipeline.stragglers import GraceWindow, judged_bandwidths

logger = logging.getLogger(__name__)
NO_WINDOW = GraceWindow(ratio=0.0)


class GracefulPartReducer(TensorPartReducer):
    """hivemind's TensorPartReducer with a grace window for the last senders of each part.

    `left_out` holds the senders left out as latecomers; `take` is where a contribution enters the part (a subclass
    may keep it instead of adding it to the running sum), `finish_current_part` where a part's average is made.
    """

    def __init__(self, part_shapes: Sequence[torch.Size], num_senders: int, grace: Optional[GraceWindow] = None):
        self.grace = grace or NO_WINDOW
        self.left_out: Set[int] = set()
        self.part_results: Dict[int, asyncio.Future] = {}  # part index -> its average, for latecomers
        self._part_started_at = time.monotonic()
        self._window: Optional[asyncio.TimerHandle] = None
        super().__init__(part_shapes, num_senders)

    def left_out_of(self, sender_index: int, part_index: int) -> bool:
        """Whether that sender's contribution to that part was left out as late."""
        return sender_index in self.left_out and part_index >= self.sender_failed_after[sender_index]

    def reset_accumulators(self):
        self._close_window()
        super().reset_accumulators()
        if not self.finished.is_set():
            self.part_results[self.current_part_index] = self.current_part_future
            self._part_started_at = time.monotonic()

    async def accumulate_part(self, sender_index: int, part_index: int, tensor_part: torch.Tensor,
                              weight: float = 1.0) -> torch.Tensor:
        # upstream's, with a latecomer answered the part's average and the contribution entering through `take`
        assert 0 <= sender_index < self.num_senders, "invalid sender index"
        assert 0 <= part_index < self.num_parts, "invalid part index"
        self.num_parts_received[sender_index] += 1
        await self._until_current(part_index)
        if self.left_out_of(sender_index, part_index):
            return await asyncio.shield(self.part_results[part_index])
        if self.sender_failed_after[sender_index] != float("inf"):
            raise BannedException(f"sender {sender_index} was banned in background")
        assert part_index == self.current_part_index
        current_part_future = self.current_part_future
        if part_index < self.sender_failed_after[sender_index]:
            self.take(sender_index, tensor_part, weight)
            self.current_part_accumulated_from += 1
            self.check_current_part_finished()
        return await current_part_future

    async def _until_current(self, part_index: int) -> None:
        """Wait until the reducer works on `part_index` or a later part."""
        while part_index > self.current_part_index:
            finished = asyncio.create_task(self.finished.wait())
            await asyncio.wait({self.current_part_future, finished}, return_when=asyncio.FIRST_COMPLETED)
            finished.cancel()
            if self.finished.is_set():
                raise AllreduceException(f"attempted to aggregate part in a finalized {self.__class__.__name__}")

    def take(self, sender_index: int, tensor_part: torch.Tensor, weight: float) -> None:
        self.accumulator.add_(tensor_part, alpha=weight)
        self.denominator += weight

    def check_current_part_finished(self):
        assert self.current_part_accumulated_from <= self.num_current_senders
        if self.current_part_accumulated_from == self.num_current_senders:
            self.finish_current_part()
        else:
            self._open_window()

    def finish_current_part(self) -> None:
        self.current_part_future.set_result(self.accumulator.div_(self.denominator))
        self.reset_accumulators()

    def on_sender_failed(self, sender_index: int):
        if sender_index in self.left_out:
            return  # already out of every part it had not delivered: counting it out again would skip a sender
        super().on_sender_failed(sender_index)

    def finalize(self):
        # upstream's, whose warning about parts that never came leaves out the latecomers' (they come later)
        self._close_window()
        if self.finished.is_set():
            return
        if hasattr(self, "current_part_future"):
            self.current_part_future.cancel()
            del self.accumulator
        self.finished.set()
        on_time = [sender for sender in range(self.num_senders) if sender not in self.left_out]
        expected = self.num_parts * len(on_time)
        received = sum(self.num_parts_received[sender] for sender in on_time)
        if received != expected:
            logger.warning(f"Reducer: received {received / expected * 100:.1f}% of input tensors")

    # --- the window ------------------------------------------------------------------------------

    def _open_window(self) -> None:
        if self._window is not None or self.finished.is_set():
            return
        quorum = self.grace.quorum(self.num_current_senders)
        if quorum is None or self.current_part_accumulated_from < quorum:
            return
        window = self.grace.window(time.monotonic() - self._part_started_at)
        self._window = asyncio.get_event_loop().call_later(window, self._leave_out_latecomers, self.current_part_index)

    def _close_window(self) -> None:
        if getattr(self, "_window", None) is not None:
            self._window.cancel()
            self._window = None

    def _leave_out_latecomers(self, part_index: int) -> None:
        self._window = None
        if self.finished.is_set() or part_index != self.current_part_index:
            return
        # a sender that has not delivered this part has delivered every earlier one (or the part would not be
        # current): out of this part and the later ones, all at once, so the next part expects none of them
        late = [sender for sender in range(self.num_senders)
                if self.sender_failed_after[sender] == float("inf") and self.num_parts_received[sender] <= part_index]
        if not late:
            return
        for sender in late:
            self.left_out.add(sender)
            self.sender_failed_after[sender] = part_index
        self.num_current_senders -= len(late)
        self.check_current_part_finished()


# --- the averager: a finished round's runner serves its latecomers ----------------------------------------------

LATECOMERS_ATTRIBUTE = "_swarmtrain_latecomer_runners"
plain_rpc_aggregate_part = DecentralizedAverager.rpc_aggregate_part


def keep_for_latecomers(averager: DecentralizedAverager, group_id: bytes, runner, seconds: float) -> None:
    """After `runner`'s round ended here: its left-out senders may still connect, for `seconds` at most."""
    if not runner.awaits_latecomers():
        return
    runners = averager.__dict__.setdefault(LATECOMERS_ATTRIBUTE, {})
    runners[group_id] = runner
    asyncio.get_event_loop().call_later(seconds, runners.pop, group_id, None)


async def rpc_aggregate_part_serving_latecomers(
    self: DecentralizedAverager, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
) -> AsyncIterator[averaging_pb2.AveragingData]:  # hivemind's servicer reads these annotations
    request = await anext(stream)
    stream = achain(as_aiter(request), stream)
    runners = self.__dict__.get(LATECOMERS_ATTRIBUTE, {})
    runner = runners.get(request.group_id)
    if runner is not None and request.group_id not in self._running_groups:
        async for message in runner.rpc_aggregate_part(stream, context):
            yield message
        if not runner.awaits_latecomers():  # the last one has its averages: the round's tensors can go
            runners.pop(request.group_id, None)
        return
    async for message in plain_rpc_aggregate_part(self, stream, context):
        yield message


# --- load balancing ------------------------------------------------------------------------------

plain_load_balance_peers = averager_module.load_balance_peers


def load_balance_peers_judging_claims(vector_size, bandwidths, min_size: int = 0):
    """Upstream's, on the bandwidths that the members' claims come to (judged_bandwidths); a group in which none is
    left to reduce is split evenly instead of failing its round."""
    bandwidths = judged_bandwidths(bandwidths)
    if all(bandwidth == 0 for bandwidth in bandwidths):
        bandwidths = [None] * len(bandwidths)
    return plain_load_balance_peers(vector_size, bandwidths, min_size)


_AVERAGER = "hivemind.averaging.averager"
PATCHES = {
    f"{_AVERAGER}.DecentralizedAverager.rpc_aggregate_part": rpc_aggregate_part_serving_latecomers,
    f"{_AVERAGER}.load_balance_peers": load_balance_peers_judging_claims,
    "hivemind.optim.power_sgd_averager.load_balance_peers": load_balance_peers_judging_claims,
}
