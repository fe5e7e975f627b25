"""A slow peer does not hold its group back (averaging/pipeline/stragglers.py): real averagers on 127.0.0.1.

Three averagers in this process, one of which is slow: its contributions reach the reducers seconds after the
others' (the two others end their round without it, and it ends the round with exactly their average), or its
replies as a reducer do (its group finds it late, and gives it nothing to reduce in the next round).
"""
from __future__ import annotations

import asyncio
import ctypes
import multiprocessing as mp
from typing import AsyncIterator

import hivemind
import pytest
import torch
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2

from averaging.pipeline import completeness, round_pipeline
from averaging.pipeline.completeness import Completeness
from averaging.pipeline.stragglers import GraceWindow
from averaging.strategies.membership import declare_bandwidth
from tests.inprocess.test_canonical_replies import assert_bit_identical, distinct_values
from tests.inprocess.test_robust_allreduce import average_all, averagers

_SEND_DELAY = []  # in an averager's own process: the delay of its averager's uplink


class AveragerWithSlowUplink(hivemind.averaging.DecentralizedAverager):
    """A peer whose contributions reach each reducer `send_delay.value` seconds late.

    Every peer of the test uses this class: hivemind names its handlers after the class, so they must match."""

    def __init__(self, *args, **kwargs):
        self.send_delay = mp.RawValue(ctypes.c_double, 0.0)  # before the fork: shared with its process
        self.reply_delay = mp.RawValue(ctypes.c_double, 0.0)
        super().__init__(*args, **kwargs)

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        async for message in super().rpc_aggregate_part(stream, context):
            await asyncio.sleep(self.reply_delay.value)  # as a reducer, its replies come late
            yield message
        if self.reply_delay.value:  # and its stream closes a while after its last reply (a sender's round may end
            await asyncio.sleep(1.0)  # first: it must have noted when that reply came all the same)

    def run(self):  # in the averager's own process, which runs this averager alone
        _SEND_DELAY.append(self.send_delay)
        super().run()

    @classmethod
    def get_stub(cls, p2p, peer, *, namespace=None):
        stub = super().get_stub(p2p, peer, namespace=namespace)
        return _DelayedSender(stub, _SEND_DELAY[0].value) if _SEND_DELAY and _SEND_DELAY[0].value else stub


class _DelayedSender:
    def __init__(self, stub, delay: float):
        self._stub, self._delay = stub, delay

    def __getattr__(self, name):
        return getattr(self._stub, name)

    async def rpc_aggregate_part(self, inputs: AsyncIterator):
        async def delayed():
            await asyncio.sleep(self._delay)
            async for message in inputs:
                yield message
        return await self._stub.rpc_aggregate_part(delayed())


GRACE = GraceWindow(ratio=0.1, min_seconds=1.0)
"""A second at least for the contributions in time: a loaded machine delivers a peer's own part a few hundred ms
after the quorum's (0.25 s left one out under CI's load), and the slow peer's delays are 4 and 5 s."""


def left_out_fraction(averager) -> float:
    return round_pipeline.of(averager).stage(Completeness).left_out_fraction()


def set_values(group, values) -> None:
    for averager, value in zip(group, values):
        with averager.get_tensors() as (tensor,):
            tensor.copy_(value)


def held(averager) -> torch.Tensor:
    with averager.get_tensors() as (tensor,):
        return tensor.clone()


@pytest.mark.timeout(120)
def test_a_slow_sender_is_left_out_of_the_round_and_ends_it_with_its_groups_average():
    values = distinct_values(3)
    with averagers([value.clone() for value in values], prefix="stragglers", averager_class=AveragerWithSlowUplink,
                   stages=[GRACE]) as group:
        slow = group[2]
        # each of its contributions arrives 4 s late: far past the window, even where a loaded machine slows the others
        slow.send_delay.value = 4.0
        results = average_all(group)
        assert all(isinstance(result, dict) and len(result) == 3 for result in results), results
        # nobody waited for it (the part it reduces itself has its own contribution), and it holds its group's
        # average bit for bit: the parts others reduced without it came to it as their average
        assert_bit_identical(group)
        assert left_out_fraction(slow) >= 0.5  # the parts the others reduce: two or three of the four
        assert [left_out_fraction(averager) for averager in group[:2]] == [0.0, 0.0]

        # standing aside (as its role would have it after that round): it reduces nothing, and its group's
        # average is the two others', which it holds too
        set_values(group, values)
        slow.bandwidth = 0.0
        assert all(isinstance(result, dict) for result in average_all(group))
        assert_bit_identical(group)
        assert torch.allclose(held(group[0]), (values[0] + values[1]) / 2, atol=1e-6)
        assert left_out_fraction(slow) == 1.0

        # in time again: its contribution is part of the next round's average
        slow.send_delay.value, slow.bandwidth = 0.0, None
        set_values(group, values)
        assert all(isinstance(result, dict) for result in average_all(group))
        assert_bit_identical(group)
        assert torch.allclose(held(group[0]), sum(values) / 3, atol=1e-6)
        assert [left_out_fraction(averager) for averager in group] == [0.0, 0.0, 0.0]


def judged_slow(averager) -> bool:
    return round_pipeline.of(averager).stage(Completeness).judged_slow()


@pytest.mark.timeout(120)
def test_a_slow_reducer_is_found_late_by_its_group_and_reduces_nothing_in_the_next_round():
    values = distinct_values(3)
    with averagers([value.clone() for value in values], prefix="slow_reducer", averager_class=AveragerWithSlowUplink,
                   stages=[GRACE]) as group:
        slow = group[2]
        # each of its replies comes 5 s late: the others wait for its part, far past the window (a loaded machine
        # may hold a round's quorum back by a few seconds, and the window with it)
        slow.reply_delay.value = 5.0
        assert all(isinstance(result, dict) for result in average_all(group))
        assert_bit_identical(group)
        assert torch.allclose(held(group[0]), sum(values) / 3, atol=1e-6)  # its contribution came in time
        slow_id = slow.peer_id.to_base58()
        assert [completeness.late_reducers(averager) for averager in group[:2]] == [{slow_id}, {slow_id}]

        # each declares what it found (as the strategies do after a round): both others found the slow one late
        declare_bandwidth(group, None)
        set_values(group, values)
        assert all(isinstance(result, dict) for result in average_all(group))
        assert_bit_identical(group)
        assert torch.allclose(held(group[0]), sum(values) / 3, atol=1e-6)  # it still contributes
        assert [judged_slow(averager) for averager in group] == [False, False, True]
        assert [completeness.late_reducers(averager) for averager in group[:2]] == [set(), set()]
