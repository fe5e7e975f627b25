"""Canonical replies: every peer of a group ends a round with bit-identical averages.

hivemind's reducer replies to each sender with `average - that sender's part`, and the sender adds the reply
to its own part. Floating-point addition does not undo the subtraction exactly, and a lossy codec rounds each
sender's delta differently, so peers that averaged together end a few ulps (or a codec step) apart: enough
that a digest of their state never matches (averaging/swarm/digests.py). CanonicalAllReduceRunner instead
serializes the average of each part once and sends those same bytes to every sender; the reducer itself takes
the decoded bytes for its own part. Rounds that average parameters reply losslessly (a codec step on a
parameter would be a step of noise on the model); rounds of gradients reply with the codec their senders used,
so a reply weighs what a contribution weighs. Where that codec is the averager's own (ours, with its settings:
top-k's fraction, say) the reducer encodes with it, and with error feedback it encodes the average plus its
reply residual and keeps what the encoding lost (averaging/pipeline/error_feedback.py).

The runner's reducer has a grace window (averaging/adapter/grace.py): a sender whose contribution to a part came
too late still receives the part's average, and the reply's `weight` field, which upstream leaves unused in
replies, says so (LEFT_OUT); `left_out_size` counts what of this peer's own contribution was left out that way, and
`replied_after_seconds` when each reducer's last reply (this peer's own part: its average) came.
Overrides upstream code averaging/adapter/upstream.py fingerprints.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import AsyncIterator, Dict, Optional, Sequence, Set

import torch
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.partition import AllreduceException, BannedException, TensorPartContainer
from hivemind.compression import CompressionBase, CompressionInfo, deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.asyncio import aenumerate, aiter_with_timeout, amap_in_executor, attach_event_on_finished

from averaging.adapter.grace import GracefulPartReducer
from averaging.adapter.partition import FeedbackPartContainer, PartLocator
from averaging.pipeline.error_feedback import ErrorFeedback, message_with_feedback
from averaging.pipeline.stragglers import GraceWindow

logger = logging.getLogger(__name__)

LOSSLESS = runtime_pb2.CompressionType.NONE
INCLUDED, LEFT_OUT = 1.0, -1.0
"""The `weight` of a reply: whether the sender's contribution is in the part's average, or came too late."""
CONTAINER_OPTIONS = ("compression", "part_size_bytes", "tensor_infos", "prefetch")


def deserialize_part(serialized: runtime_pb2.Tensor, expected_numel: int, sender) -> torch.Tensor:
    """A part another peer sent, decoded only if it claims the size the part has here: a decoder allocates what
    the message's `size` says, which a few hostile bytes could make gigabytes."""
    numel = math.prod(serialized.size)
    if numel != expected_numel or any(dimension < 0 for dimension in serialized.size):
        raise AllreduceException(f"{sender} sent a part of {numel} values where {expected_numel} were due")
    return deserialize_torch_tensor(serialized)


class CanonicalAllReduceRunner(AllReduceRunner):
    """hivemind's AllReduceRunner, replying with each part's average serialized once for all senders.

    Its output is the average itself (not a delta), so a peer adopts it with `copy_`.

    :param lossless_replies: reply without compression whatever codec the senders used (parameter rounds)
    :param carried: error feedback's residuals, already added into `tensors` (a FeedbackPartContainer then
      keeps what the codec loses)
    :param reply_feedback: the averager's error feedback, whose reply residuals (shaped like `tensors`) each reply
      this peer encodes carries for its stretch, and replaces there by what that encoding lost
    :param grace: the grace window of this peer's reducer (None: wait for every sender, as upstream)
    """

    def __init__(self, *, tensors: Sequence[torch.Tensor], lossless_replies: bool = False,
                 carried: Optional[Sequence[torch.Tensor]] = None, reply_feedback: Optional[ErrorFeedback] = None,
                 grace: Optional[GraceWindow] = None, **kwargs):
        super().__init__(tensors=tensors, **kwargs)
        self.lossless_replies = lossless_replies
        self.codec: Optional[CompressionBase] = kwargs.get("compression")
        self.reply_feedback = reply_feedback
        self._locate = PartLocator(tensors) if reply_feedback is not None else None
        self.left_out_size = 0  # elements of this peer's contribution that reducers left out as late
        self.replied_after_seconds: Dict[str, float] = {}  # reducer (base58) -> when its last reply came
        self._started_at = time.monotonic()
        self._served: Set[int] = set()  # senders that received every part's average
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
        upstream_reducer = self.tensor_part_reducer
        upstream_reducer.finished.set()  # never used: finalizing it would warn that it received nothing
        self.tensor_part_reducer = self.make_reducer(upstream_reducer.part_shapes, grace)

    def make_reducer(self, part_shapes, grace: Optional[GraceWindow]) -> GracefulPartReducer:
        return GracefulPartReducer(part_shapes, len(self.sender_peer_ids), grace)

    def awaits_latecomers(self) -> bool:
        """Whether a sender left out as late has yet to receive every part's average."""
        return bool(self.tensor_part_reducer.left_out - self._served)

    def serves_latecomer(self, peer_id) -> bool:
        """Whether `peer_id` is a sender this runner left out as late and still answers after its round ended."""
        done = self._future.done() and not self._future.cancelled() and self._future.exception() is None
        return done and self.sender_peer_ids.index(peer_id) in self.tensor_part_reducer.left_out

    def _check_reasons_to_reject(self, request: averaging_pb2.AveragingData, context):
        reason = super()._check_reasons_to_reject(request, context)
        if reason is not None and reason.code == averaging_pb2.INTERNAL_ERROR and self.serves_latecomer(
                context.remote_id):
            return None  # this round is over here, but the latecomer still gets its average
        return reason

    async def _serialized_average(self, part_index: int, averaged_part: torch.Tensor) -> runtime_pb2.Tensor:
        """The reply for a part: serialized on its first request, the same bytes for every later one."""
        reply = self._replies.get(part_index)
        if reply is None:
            reply = self._replies[part_index] = asyncio.get_event_loop().run_in_executor(
                None, self._encode_average, part_index, averaged_part)
        return await asyncio.shield(reply)  # one sender giving up must not cancel the others' reply

    def _encode_average(self, part_index: int, averaged_part: torch.Tensor) -> runtime_pb2.Tensor:
        codec_id = LOSSLESS if self.lossless_replies else self._reply_codecs.get(part_index, LOSSLESS)
        if self.codec is None or getattr(self.codec, "compression_type", None) != codec_id:
            return serialize_torch_tensor(averaged_part, codec_id)  # hivemind's codecs: one per id, no settings
        if self.reply_feedback is None:
            return self.codec.compress(averaged_part, CompressionInfo.from_tensor(averaged_part))
        # each part is encoded once, into its own stretch: what it lost is final as soon as the bytes are, sent or not
        index, where = self._locate(self.parts_for_local_averaging[part_index])
        feedback = self.reply_feedback
        with feedback.lock:
            carried = feedback.reply_residuals[index].view(-1)[where].clone()
        message, lost = message_with_feedback(averaged_part, carried, self.codec)
        with feedback.lock:
            feedback.reply_residuals[index].view(-1)[where].copy_(lost)
        return message

    async def _communicate_with_peer(self, peer_id):
        if peer_id != self.peer_id:
            return await self._exchange_with_reducer(peer_id)
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
        self._replied(peer_id)

    def _replied(self, reducer) -> None:
        self.replied_after_seconds[reducer.to_base58()] = time.monotonic() - self._started_at

    async def _exchange_with_reducer(self, peer_id):
        # upstream's _communicate_with_peer for another peer, counting the parts whose replies say LEFT_OUT
        peer_index = self.ordered_peer_ids.index(peer_id)
        expected_parts = self.tensor_part_container.num_parts_by_peer[peer_index]
        part_index = 0
        try:
            done_sending = asyncio.Event()
            inputs_aiter = attach_event_on_finished(self._generate_input_for_peer(peer_index), done_sending)
            stream = await self._get_peer_stub(peer_id).rpc_aggregate_part(inputs_aiter)
            if self.should_delay_results(self.peer_id):
                await done_sending.wait()

            sent_parts = self.tensor_part_container._input_parts_by_peer[peer_index]

            def _try_deserialize(indexed):
                index, msg = indexed
                if msg.code != averaging_pb2.AVERAGED_PART:
                    raise AllreduceException(f"{peer_id} sent {averaging_pb2.MessageCode.Name(msg.code)}")
                if index >= len(sent_parts):
                    raise AllreduceException(f"{peer_id} sent more than the {len(sent_parts)} parts due")
                return deserialize_part(msg.tensor_part, sent_parts[index][0].numel(), peer_id), msg

            async for average, msg in amap_in_executor(
                _try_deserialize, aenumerate(aiter_with_timeout(stream, self.reducer_timeout)),
                max_prefetch=self.tensor_part_container.prefetch,
            ):
                if msg.weight == LEFT_OUT:
                    self.left_out_size += average.numel()
                if part_index + 1 == expected_parts:  # noted before the last part can end the round, not after
                    self._replied(peer_id)  # the stream closes (the round's end may come first, and miss it)
                self.tensor_part_container.register_processed_part(peer_index, part_index, average)
                part_index += 1
            if part_index != expected_parts:
                raise AllreduceException(f"peer {peer_id} sent {part_index} parts, but we expected {expected_parts}")
        except BaseException as e:
            if isinstance(e, Exception):  # upstream says so at debug level only: a partial round went unexplained
                logger.warning(f"Reducer {peer_id} failed after {part_index} of {expected_parts} parts ({e!r}): "
                               f"this peer keeps its own values there")
                logger.debug(f"Caught {e!r} when communicating to {peer_id}", exc_info=True)
            self.tensor_part_container.register_failed_reducer(peer_index)
            raise

    async def _accumulate_parts_streaming(self, stream: AsyncIterator[averaging_pb2.AveragingData],
                                          sender_index: int):
        # upstream's, replying with the part's canonical average instead of this sender's delta to it
        part_index = 0
        try:
            part_shapes, sender = self.tensor_part_reducer.part_shapes, self.sender_peer_ids[sender_index]

            def _deserialize(indexed):
                index, msg = indexed
                if index >= len(part_shapes):
                    raise AllreduceException(f"{sender} sent more than the {len(part_shapes)} parts due")
                expected = math.prod(part_shapes[index])
                return deserialize_part(msg.tensor_part, expected, sender), msg.weight, msg.tensor_part.compression

            async for tensor_part, weight, part_compression in amap_in_executor(
                _deserialize,
                aenumerate(stream),
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
                late = self.tensor_part_reducer.left_out_of(sender_index, part_index)
                part_index += 1
                yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=reply,
                                                  weight=LEFT_OUT if late else INCLUDED)
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])
            else:
                self._served.add(sender_index)
