"""Your own task, trained by a 2-peer swarm on this machine: a template for your test suite.

Run it from the repository root (it needs pytest and pytest-asyncio, as in `pip install -e .[test]`):

    pytest examples/test_custom_task_swarm.py

`peer.testing.Swarm` starts real `peer start` processes on 127.0.0.1 and learns what they do from
their events files, never from their logs; every wait has a timeout, and leaving the `async with`
kills whatever is left. Replace the task below with yours (module:function, importable from the
directory you run pytest in).
"""
from __future__ import annotations

import math

import pytest

from peer.telemetry.events import EpochEnded
from peer.testing import Swarm, max_parameter_difference

TASK = "examples.custom_task:make_task"
EPOCHS = 5


@pytest.mark.timeout(300)
async def test_two_peers_train_the_custom_task_to_the_same_weights(tmp_path):
    async with Swarm(tmp_path, "--task", TASK, "--target-batch-size", "128", "--min-peers", "2",
                     "--max-epochs", str(EPOCHS), fast=True) as swarm:
        first, second = await swarm.start(2)
        await swarm.all_reached(epoch=EPOCHS, timeout=240)
        assert await first.exit_code(timeout=120) == 0
        assert await second.exit_code(timeout=120) == 0

        for peer in (first, second):
            val_losses = [event.val_loss for event in peer.events if isinstance(event, EpochEnded)]
            # it learns: a model that cannot tell the spirals apart scores ln 2. Five large-batch steps reach the
            # first plateau (about 0.6) in one or two, and then wander on it, so the last epoch need not beat the first
            assert val_losses[-1] < math.log(2), val_losses
        # they averaged every epoch, so they end with the same weights
        assert max_parameter_difference(first.model_state(), second.model_state()) <= 1e-5
