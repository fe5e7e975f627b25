"""One epoch of a sync swarm is one large-batch step.

Two peers that each average the gradients of half a batch must apply exactly the update that one optimizer applies
to the whole batch: AdamW's moments, its weight decay and a warmup schedule included, epoch after epoch. Real
hivemind averagers in this process; the reference is plain torch.
"""
from __future__ import annotations

import copy

import pytest
import torch
from hivemind.utils.crypto import RSAPrivateKey

from averaging.api import AveragingHooks, Replica
from averaging.config import AveragingConfig
from averaging.strategies.factory import build_swarm_optimizer
from dht.keys import SwarmKeys
from tests.inprocess.test_averaging import run_in_threads, start_dhts
from tests.peers import wait_until

EPOCHS = 4
HALF = 4  # samples per peer per epoch


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


def make_scheduler(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: min(1.0, (epoch + 1) / 3))  # bytelm's warmup


@pytest.mark.timeout(150)
def test_two_sync_peers_apply_exactly_the_large_batch_update_of_one_optimizer():
    # each peer's half reaches the target on its own, so both enter the epoch's round together, as peers do once
    # their trackers see the swarm's samples reach the target
    # weights capped at one fair share each: equal halves weigh the same whenever each peer's progress record
    # reached the other's reducer (a peer that claims more than its share is weighed by what its records show)
    config = AveragingConfig(strategy="sync", target_batch_size=HALF, matchmaking_seconds=1.0,
                             averaging_timeout_seconds=20.0, robust_max_weight_share=1.0)
    torch.manual_seed(5)
    start = torch.nn.Linear(3, 2)
    generator = torch.Generator().manual_seed(7)
    inputs = torch.randn(EPOCHS, 2 * HALF, 3, generator=generator)
    targets = torch.randn(EPOCHS, 2 * HALF, 2, generator=generator)

    reference = copy.deepcopy(start)
    reference_optimizer = make_optimizer(reference.parameters())
    reference_scheduler = make_scheduler(reference_optimizer)

    dhts = start_dhts(2)
    peers, models, reports = [], [], []
    try:
        for dht in dhts:
            model = copy.deepcopy(start)
            peers.append(build_swarm_optimizer(config, Replica(
                dht=dht, keys=SwarmKeys.for_run("large_batch"), params=model.parameters(),
                optimizer_factory=make_optimizer, scheduler_factory=make_scheduler, batch_size=HALF,
                client_mode=False, hooks=AveragingHooks(round_finished=reports.append),
            ), tracker_opts=dict(private_key=RSAPrivateKey())))  # one signing key per peer, as between processes
            models.append(model)
        wait_until(lambda: [peer.announce() for peer in peers] and all(peer.swarm_view().peers == 2 for peer in peers),
                   60, interval=1.0, message="both trackers to see both peers")

        def local_step(index: int, epoch: int):
            def step():
                half = slice(index * HALF, (index + 1) * HALF)
                loss = torch.nn.functional.mse_loss(models[index](inputs[epoch, half]), targets[epoch, half])
                loss.backward()
                peers[index].step(batch_size=HALF)
                peers[index].zero_grad()
            return step

        for epoch in range(EPOCHS):
            run_in_threads(local_step(0, epoch), local_step(1, epoch))
            torch.nn.functional.mse_loss(reference(inputs[epoch]), targets[epoch]).backward()
            reference_optimizer.step()
            reference_optimizer.zero_grad()
            reference_scheduler.step()
            for model in models:
                for got, expected in zip(model.parameters(), reference.parameters()):
                    assert torch.allclose(got, expected, atol=1e-6, rtol=0), (epoch, got, expected)
        gradient_rounds = [report for report in reports if report.group_size == 2 and report.outcome == "ok"]
        assert len(gradient_rounds) >= 2 * EPOCHS, reports  # every epoch averaged by both, none locally
        assert [peer.local_epoch for peer in peers] == [EPOCHS, EPOCHS]
        assert [peer.scheduler.last_epoch for peer in peers] == [reference_scheduler.last_epoch] * 2
    finally:
        for peer in peers:
            peer.shutdown()
        for dht in dhts:
            dht.shutdown()
