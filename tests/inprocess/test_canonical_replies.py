"""Canonical replies (averaging/adapter/runner.py): peers that averaged together hold bit-identical tensors.

With upstream's delta replies, three peers averaging bytelm-sized gradients ended with a quarter of their
values a few ulps apart, and nearly all apart with an fp16 codec: no digest of their state could ever match.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools

import pytest
import torch
from hivemind.averaging.partition import AllreduceException
from hivemind.compression import CompressionInfo
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.proto import runtime_pb2

from averaging import adapter
from averaging.adapter.runner import CanonicalAllReduceRunner, deserialize_part
from averaging.codecs.compression import make_codec
from averaging.pipeline import completeness
from averaging.pipeline.defence import Defence
from averaging.pipeline.robust import RobustPolicy
from tests.inprocess.test_averaging import run_in_threads, start_dhts
from tests.inprocess.test_robust_allreduce import SIZE, average_all, averagers, honest_values

PEERS = 3
ATTEMPTS = 3


def distinct_values(count: int):
    # values whose mean is not exactly representable: delta replies would leave each peer a different rounding
    return [honest_values(seed) * (1 + seed / 3) for seed in range(count)]


def assert_bit_identical(group) -> None:
    held = []
    for averager in group:
        with averager.get_tensors() as (tensor,):
            held.append(tensor.clone())
    for other in held[1:]:
        assert torch.equal(held[0], other), f"{(held[0] != other).sum().item()} of {SIZE} values differ"


@contextlib.contextmanager
def one_whole_round(values, prefix: str, make_defence=None, **options):
    """Averagers of `values` that ran one round in which every peer received every part.

    hivemind ends a round in which a reducer's stream failed as if it had succeeded, with the peer's own values in
    that reducer's part (averaging/pipeline/completeness.py). Such a round is partial, not canonical: the daemon
    sees it and downloads the swarm's state (tests/inprocess/test_partial_rounds.py). Canonical replies are about
    whole rounds, so a partial round (a libp2p stream failing on a loaded machine), or one that some peer did not
    end in one group with all the others (matchmaking that ran out of time), is run again with fresh averagers;
    the log says why."""
    for attempt in range(ATTEMPTS):
        defences = [make_defence() for _ in values] if make_defence else None
        with averagers([value.clone() for value in values], defences=defences, prefix=f"{prefix}_{attempt}",
                       **options) as group:
            results = average_all(group)
            in_one_group = all(isinstance(result, dict) and len(result) == len(group) for result in results)
            if in_one_group and not any(completeness.missing_fraction(averager) for averager in group):
                yield group
                return
    pytest.fail(f"{ATTEMPTS} rounds in a row were not whole: see the log for the peers and reducers that failed")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("codec", ["none", "fp16", "int8", "int4", "topk"])
def test_three_peers_end_a_round_with_bit_identical_averages(codec):
    values = distinct_values(PEERS)
    with one_whole_round(values, prefix=f"canonical_{codec}", compression=make_codec(codec)) as group:
        assert_bit_identical(group)
        with group[0].get_tensors() as (tensor,):
            mean = sum(values) / PEERS
            # what the codec itself loses on both legs (relative L2); topk at 1% keeps little of a dense mean
            tolerance = {"none": 1e-6, "fp16": 1e-3, "int8": 0.01, "int4": 0.12, "topk": 1.0}[codec]
            assert float((tensor - mean).norm() / mean.norm()) < tolerance


@pytest.mark.timeout(240)
def test_robust_reducers_reply_canonically_too():
    with one_whole_round(distinct_values(PEERS), prefix="canonical_robust", compression=make_codec("fp16"),
                         make_defence=lambda: Defence(RobustPolicy())) as group:
        assert_bit_identical(group)


def serialized_reply(lossless: bool, senders_codec: str, average=None, **settings):
    runner = CanonicalAllReduceRunner.__new__(CanonicalAllReduceRunner)  # just its reply cache
    runner.lossless_replies, runner._replies, runner.reply_feedback = lossless, {}, None
    runner.codec = make_codec(senders_codec, **settings)
    runner._reply_codecs = {0: runner.codec.compression_type}
    average = torch.randn(64) if average is None else average

    async def twice():
        return await runner._serialized_average(0, average), await runner._serialized_average(0, average * 2)
    return asyncio.new_event_loop().run_until_complete(twice())


def test_a_part_is_serialized_once_with_its_senders_codec_or_losslessly_for_parameters():
    first, second = serialized_reply(lossless=False, senders_codec="fp16")
    assert first is second  # every sender gets the same bytes
    assert first.compression == runtime_pb2.CompressionType.FLOAT16
    first, _ = serialized_reply(lossless=True, senders_codec="fp16")
    assert first.compression == runtime_pb2.CompressionType.NONE


@pytest.mark.parametrize("codec, settings", [
    ("int8", {}), ("int4", {}),
    ("topk", dict(topk_fraction=0.05, topk_chunk=64, topk_value_bits=2)),  # not what the registry's decoder holds
])
def test_our_codecs_reply_in_themselves_with_the_averagers_settings(codec, settings):
    average = torch.randn(4096)
    reply, _ = serialized_reply(lossless=False, senders_codec=codec, average=average, **settings)
    ours = make_codec(codec, **settings)
    assert reply.compression == ours.compression_type
    assert reply.buffer == ours.compress(average, CompressionInfo.from_tensor(average)).buffer  # not dense fp16


@pytest.mark.timeout(120)
def test_parameter_averaging_with_a_lossy_codec_gives_every_peer_the_exact_mean():
    adapter.install()
    dhts = start_dhts(2)
    values = distinct_values(2)
    parameters = [torch.nn.Parameter(value.clone()) for value in values]
    built = []
    try:
        for dht, parameter in zip(dhts, parameters):
            built.append(TrainingStateAverager(
                dht=dht, optimizer=functools.partial(torch.optim.SGD, lr=0.1), params=[parameter],
                prefix="canonical_state", target_group_size=2, min_group_size=2, min_matchmaking_time=2.0,
                request_timeout=1.0, compression=make_codec("fp16"), start=True))

        def average(index):
            return lambda: built[index].step(averaging_round=True, averaging_opts=dict(timeout=30))
        run_in_threads(average(0), average(1), timeout=60)
        mean = (values[0] + values[1]) / 2
        assert torch.equal(parameters[0].detach(), parameters[1].detach())
        # replies in fp16 would round each parameter by up to 1e-3 of its size; the senders' fp16 parts cost less
        assert (parameters[0].detach() - mean).abs().max() < (mean.half().float() - mean).abs().max()
    finally:
        for averager in built:
            averager.shutdown()
        for dht in dhts:
            dht.shutdown()


@pytest.mark.parametrize("codec", ["none", "int4", "topk"])
def test_a_part_that_claims_another_size_is_refused_before_it_is_decoded(codec):
    """A decoder allocates what a message's size says: a few hostile bytes claiming 2**30 values (4 GiB) must not
    make a peer allocate them."""
    adapter.install()  # our codecs' decoders
    part = torch.randn(1000)
    message = make_codec(codec).compress(part, CompressionInfo.from_tensor(part))
    assert torch.equal(deserialize_part(message, 1000, "a sender"), make_codec(codec).extract(message))
    message.size[:] = [2**30]
    with pytest.raises(AllreduceException, match="a sender sent a part of 1073741824 values where 1000 were due"):
        deserialize_part(message, 1000, "a sender")
