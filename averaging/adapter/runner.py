"""Canonical replies: every peer of a group ends a round with bit-identical averages.

hivemind's reducer replies to each sender with `average - that sender's part`, and the sender adds the reply
to its own part. Floating-point addition does not undo the subtraction exactly, and a lossy codec rounds each
sender's delta differently, so peers that averaged together end a few ulps (or a codec step) apart: enough
that a digest of their state never matches (averaging/swarm/digests.py). CanonicalAllReduceRunner instead
serializes the average of each part once and sends those same bytes to every sender; the reducer itself takes
the decoded bytes for its own part. Rounds that average parameters reply losslessly (a codec step on a
parameter would be a step of noise on the model); rounds of gradients reply with the codec their senders used,
as upstream does, so their payload is unchanged. Overrides upstream code averaging/adapter/upstream.py
fingerprints.
"""
from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, Dict, Optional, Sequence

import torch
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.partition import BannedException, TensorPartContainer
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.asyncio import amap_in_executor

from averaging.adapter.partition import FeedbackPartContainer

logger = logging.getLogger(__name__)

LOSSLESS = runtime_pb2.CompressionType.NONE
CONTAINER_OPTIONS = ("compression", "part_size_bytes", "tensor_infos", "prefetch")


class CanonicalAllReduceRunner(AllReduceRunner):
    """hivemind's AllReduceRunner, replying with each part's average serialized once for all senders.

    Its output is the average itself (not a delta), so a peer adopts it with `copy_`.

    :param lossless_replies: reply without compression whatever codec the senders used (parameter rounds)
    :param carried: error feedback's residuals, already added into `tensors` (a FeedbackPartContainer then
      keeps what the codec loses)
    """

    def __init__(self, *, tensors: Sequence[torch.Tensor], lossless_replies: bool = False,
                 carried: Optional[Sequence[torch.Tensor]] = None, **kwargs):
        super().__init__(tensors=tensors, **kwargs)
        self.lossless_replies = lossless_replies
        self._replies: Dict[int, asyncio.Future] = {}  # part index -> its average, serialized once
        self._reply_codecs: Dict[int, int] = {}  # part index -> the codec its senders used
        own_index = self.ordered_peer_ids.index(self.peer_id)
        options = {key: kwargs[key] for key in CONTAINER_OPTIONS if key in kwargs}
        # upstream's __init__ built a delta-returning container; this one returns the average itself
        self.tensor_part_container.finalize()
        if carried is None:
            self.tensor_part_container = TensorPartContainer(tensors, self.peer_fractions, return_deltas=False,
                                                             **options)
        else:
            self.tensor_part_container = FeedbackPartContainer(tensors, self.peer_fractions, carried, own_index,
                                                               **options)
        self.parts_for_local_averaging = self.tensor_part_container.get_raw_input_parts(own_index)

    async def _serialized_average(self, part_index: int, averaged_part: torch.Tensor) -> runtime_pb2.Tensor:
        """The reply for a part: serialized on its first request, the same bytes for every later one."""
        reply = self._replies.get(part_index)
        if reply is None:
            codec = LOSSLESS if self.lossless_replies else self._reply_codecs.get(part_index, LOSSLESS)
            reply = self._replies[part_index] = asyncio.get_event_loop().run_in_executor(
                None, serialize_torch_tensor, averaged_part, codec)
        return await asyncio.shield(reply)  # one sender giving up must not cancel the others' reply

    async def _communicate_with_peer(self, peer_id):
        if peer_id != self.peer_id:
            return await super()._communicate_with_peer(peer_id)
        # this peer's own part: the bytes its other senders receive, decoded; every other sender's part
        # (and so its codec) has arrived by the time the average is known
        peer_index = self.ordered_peer_ids.index(peer_id)
        sender_index = self.sender_peer_ids.index(peer_id)
        for part_index, tensor_part in enumerate(self.parts_for_local_averaging):
            averaged_part = await self.tensor_part_reducer.accumulate_part(
                sender_index, part_index, tensor_part, weight=self.weight)
            reply = await self._serialized_average(part_index, averaged_part)
            self.tensor_part_container.register_processed_part(
                peer_index, part_index, deserialize_torch_tensor(reply))

    async def _accumulate_parts_streaming(self, stream: AsyncIterator[averaging_pb2.AveragingData],
                                          sender_index: int):
        # upstream's, replying with the part's canonical average instead of this sender's delta to it
        part_index = 0
        try:
            async for tensor_part, weight, part_compression in amap_in_executor(
                lambda msg: (deserialize_torch_tensor(msg.tensor_part), msg.weight, msg.tensor_part.compression),
                stream,
                max_prefetch=self.tensor_part_container.prefetch,
            ):
                self._reply_codecs.setdefault(part_index, part_compression)
                try:
                    averaged_part = await self.tensor_part_reducer.accumulate_part(
                        sender_index, part_index, tensor_part, weight=weight)
                except BannedException:
                    logger.debug(f"Sender {sender_index} is already banned")
                    break  # the sender was banned: its part is no longer aggregated
                reply = await self._serialized_average(part_index, averaged_part)
                part_index += 1
                yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=reply)
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])
