"""Refusals: an averager whose pipeline refuses a peer (an excluded one, averaging/pipeline/defence.py) neither
takes it into a group as a leader or a follower, nor serves it state, nor downloads state from it."""
from __future__ import annotations

from typing import AsyncIterator, Callable, Dict

from hivemind.averaging.averager import DecentralizedAverager
from hivemind.averaging.matchmaking import Matchmaking
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import as_aiter

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
    return _NoStateStub(stub) if round_pipeline.running().refuses(peer) else stub


_AVERAGER = "hivemind.averaging.averager.DecentralizedAverager"
PATCHES: Dict[str, Callable] = {
    f"{_AVERAGER}.rpc_join_group": rpc_join_group_refusing_excluded,
    f"{_AVERAGER}.rpc_download_state": rpc_download_state_refusing_excluded,
    f"{_AVERAGER}.get_stub": get_stub_without_excluded_donors,
    "hivemind.averaging.matchmaking.Matchmaking._request_join_group": request_join_group_skipping_excluded,
}
