"""A slow sender does not hold its group back (averaging/pipeline/stragglers.py): real averagers on 127.0.0.1.

Three averagers in this process, one of whose uplink is slow: its contributions reach the reducers seconds after
the others'. The two others end their round without it, and it ends the round with exactly their average.
"""
from __future__ import annotations

import asyncio
import ctypes
import multiprocessing as mp
from typing import AsyncIterator

import hivemind
import pytest
import torch

from averaging.pipeline import round_pipeline
from averaging.pipeline.completeness import Completeness
from averaging.pipeline.stragglers import GraceWindow
from tests.inprocess.test_canonical_replies import assert_bit_identical, distinct_values
from tests.inprocess.test_robust_allreduce import average_all, averagers

_SEND_DELAY = []  # in an averager's own process: the delay of its averager's uplink


class AveragerWithSlowUplink(hivemind.averaging.DecentralizedAverager):
    """A peer whose contributions reach each reducer `send_delay.value` seconds late.

    Every peer of the test uses this class: hivemind names its handlers after the class, so they must match."""

    def __init__(self, *args, **kwargs):
        self.send_delay = mp.RawValue(ctypes.c_double, 0.0)  # before the fork: shared with its process
        super().__init__(*args, **kwargs)

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
                   stages=[GraceWindow(ratio=0.1, min_seconds=0.25)]) as group:
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
