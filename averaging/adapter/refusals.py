"""Refusals: an averager whose pipeline refuses a peer (an excluded one, averaging/pipeline/defence.py) neither
takes it into a group as a leader or a follower, nor serves it state, nor downloads state from it; one that
refuses it as a donor (averaging/pipeline/donors.py) does not download state from it.

A state download also says who served it: the donor's peer id goes into the metadata as SERVED_BY, for the
training process to check what it got against what that donor published (averaging/swarm/digests.py)."""
from __future__ import annotations

from typing import AsyncIterator, Callable, Dict

from hivemind.averaging.averager import DecentralizedAverager
from hivemind.averaging.matchmaking import Matchmaking
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import as_aiter
from hivemind.utils.serializer import MSGPackSerializer

from averaging.pipeline import round_pipeline

plain_rpc_join_group = DecentralizedAverager.rpc_join_group
plain_rpc_download_state = DecentralizedAverager.rpc_download_state
plain_request_join_group = Matchmaking._request_join_group
plain_get_stub = DecentralizedAverager.get_stub


async def rpc_join_group_refusing_excluded(
    self: DecentralizedAverager, request: averaging_pb2.JoinRequest, context: P2PContext
) -> AsyncIterator[averaging_pb2.MessageFromLeader]:  # hivemind's servicer reads these annotations
    if round_pipeline.of(self).refuses(context.remote_id):
        yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
        return
    async for response in plain_rpc_join_group(self, request, context):
        yield response


async def request_join_group_skipping_excluded(self: Matchmaking, leader):
    if round_pipeline.running().refuses(leader):
        return None  # upstream's answer for a leader that did not take us: try the next one
    return await plain_request_join_group(self, leader)


async def rpc_download_state_refusing_excluded(
    self: DecentralizedAverager, request: averaging_pb2.DownloadRequest, context: P2PContext
) -> AsyncIterator[averaging_pb2.DownloadData]:
    if round_pipeline.of(self).refuses(context.remote_id):
        return  # upstream's answer when sharing is off: the peer moves on to the next donor
    async for message in plain_rpc_download_state(self, request, context):
        yield message


SERVED_BY = "served_by"


class _StampingStub:
    """A stub to a state donor whose download's metadata names the donor."""

    def __init__(self, stub, peer):
        self._stub, self._peer = stub, peer

    def __getattr__(self, name):
        return getattr(self._stub, name)

    async def rpc_download_state(self, request):
        stream = await self._stub.rpc_download_state(request)
        return _stamped(stream, self._peer.to_base58())


async def _stamped(stream, donor: str):
    async for message in stream:
        if message.metadata:
            metadata = MSGPackSerializer.loads(message.metadata)
            if isinstance(metadata, dict):
                metadata[SERVED_BY] = donor
                message.metadata = MSGPackSerializer.dumps(metadata)
        yield message


class _NoStateStub:
    """A stub to an excluded peer as a state donor: it sends nothing, so upstream moves on to the next."""

    def __init__(self, stub):
        self._stub = stub

    def __getattr__(self, name):
        return getattr(self._stub, name)

    async def rpc_download_state(self, request):
        return as_aiter()


@classmethod
def get_stub_without_excluded_donors(cls, p2p, peer, *, namespace=None):
    # called as self.get_stub only by upstream's _load_state_from_peers; the other callers go through
    # the class and reach excluded peers only in rounds that the patches above refuse anyway
    stub = plain_get_stub.__func__(cls, p2p, peer, namespace=namespace)
    return _NoStateStub(stub) if round_pipeline.running().refuses_donor(peer) else _StampingStub(stub, peer)


_AVERAGER = "hivemind.averaging.averager.DecentralizedAverager"
PATCHES: Dict[str, Callable] = {
    f"{_AVERAGER}.rpc_join_group": rpc_join_group_refusing_excluded,
    f"{_AVERAGER}.rpc_download_state": rpc_download_state_refusing_excluded,
    f"{_AVERAGER}.get_stub": get_stub_without_excluded_donors,
    "hivemind.averaging.matchmaking.Matchmaking._request_join_group": request_join_group_skipping_excluded,
}
