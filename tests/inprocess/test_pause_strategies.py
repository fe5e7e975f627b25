"""What pause() and resume() do to each strategy's own bookkeeping (the loop around them: tests/unit/test_pauser.py;
a paused peer in a real swarm: tests/reliability/test_volunteer.py)."""
from __future__ import annotations

import hivemind
import pytest
import torch

from averaging.api import Replica
from averaging.config import AveragingConfig
from averaging.strategies.factory import build_swarm_optimizer
from averaging.swarm.claims import is_paused
from dht.keys import SwarmKeys
from tests.inprocess.test_averaging import LOCALHOST

BATCH, TARGET = 4, 64  # a step never ends an epoch here


def one_step(model: torch.nn.Module, optimizer) -> None:
    model(torch.randn(BATCH, 4)).square().mean().backward()
    optimizer.step(batch_size=BATCH)
    optimizer.zero_grad()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("strategy", ["sync", "local-sgd", "diloco", "none"])
def test_a_paused_strategy_counts_nothing_claims_no_rate_and_counts_again_once_resumed(strategy: str):
    dht = hivemind.DHT(start=True, host_maddrs=LOCALHOST)
    optimizer = None
    try:
        model = torch.nn.Linear(4, 1)
        start = [p.detach().clone() for p in model.parameters()]
        config = AveragingConfig(strategy=strategy, target_batch_size=TARGET, matchmaking_seconds=1.0,
                                 averaging_timeout_seconds=5.0)
        optimizer = build_swarm_optimizer(config, Replica(
            dht=dht, keys=SwarmKeys.for_run(f"pause_{strategy.replace('-', '_')}"), params=model.parameters(),
            optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1), batch_size=BATCH, client_mode=False,
        ))
        for _ in range(3):
            one_step(model, optimizer)
        tracker = optimizer.tracker
        none = tracker.performance_ema.eps  # the rate hivemind reports before any sample: "nothing"
        assert tracker.local_progress.samples_accumulated == 3 * BATCH
        assert tracker.local_progress.samples_per_second != none

        optimizer.pause()
        assert tracker.local_progress.samples_accumulated == 0 and optimizer.local_epoch == 0
        assert tracker.local_progress.samples_per_second == none  # the others expect nothing of it
        assert optimizer.swarm_view().samples_per_second == none
        # and marked as a paused peer's record, which no other peer counts as a peer to average with
        assert tracker.local_progress.client_mode and is_paused(tracker.local_progress.dict())
        if strategy == "diloco":  # its inner steps went with the samples they counted: back at the round's start
            assert all(torch.equal(a, b.detach()) for a, b in zip(start, model.parameters()))
        if strategy == "sync":  # and what it had accumulated toward the epoch is gone
            assert optimizer.grad_averager.local_samples_accumulated == 0

        optimizer.resume()
        one_step(model, optimizer)
        assert tracker.local_progress.samples_accumulated == BATCH and tracker.local_progress.samples_per_second != none
        assert not tracker.local_progress.client_mode and not is_paused(tracker.local_progress.dict())
    finally:
        if optimizer is not None:
            optimizer.shutdown()
        dht.shutdown()
