"""An upload budget with two real DiLoCo peers on 127.0.0.1: the budget of one lengthens the swarm's rounds, both
move to the longer rounds at the same epoch, and they end every round with the same parameters, bit for bit."""
from __future__ import annotations

import logging
from typing import List

import pytest
import torch

from averaging.api import AveragingHooks, RoundLength, RoundReport
from averaging.config import AveragingConfig
from averaging.swarm.round_factor import LEAD_EPOCHS
from tests.inprocess.test_averaging import make_diloco, run_in_threads, start_dhts
from tests.peers import wait_until

ROUNDS = 6


@pytest.mark.timeout(240)
def test_a_budget_that_asks_for_longer_rounds_moves_both_peers_to_them_at_the_same_epoch_with_one_state(caplog):
    shared = dict(strategy="diloco", target_batch_size=4, matchmaking_seconds=1.0, averaging_timeout_seconds=20.0,
                  max_round_factor=2)
    # a budget nothing meets: whatever this machine's speed, it asks for the longest round the swarm allows
    configs = [AveragingConfig(**shared, max_upload_mbit=1e-6), AveragingConfig(**shared)]
    dhts = start_dhts(2)
    torch.manual_seed(0)
    models = [torch.nn.Linear(16, 16) for _ in dhts]
    models[1].load_state_dict(models[0].state_dict())
    lengths: List[List[RoundLength]] = [[], []]
    reports: List[RoundReport] = []
    peers = []
    caplog.set_level(logging.INFO, logger="averaging.strategies.round_length")
    try:
        for config, dht, model, seen in zip(configs, dhts, models, lengths):
            hooks = AveragingHooks(round_finished=reports.append, round_length=seen.append)
            peers.append(make_diloco(config, dht, model, hooks))
        wait_until(lambda: [peer.announce() for peer in peers] and all(peer.swarm_view().peers == 2 for peer in peers),
                   60, interval=1.0, message="both trackers to see both peers")
        noise = torch.Generator().manual_seed(1)
        for round_index in range(ROUNDS):
            for model in models:  # as if each peer's inner steps had moved it its own way
                with torch.no_grad():
                    for param in model.parameters():
                        param.add_(0.01 * torch.randn(param.shape, generator=noise))
            # each steps on the whole of its round's target at once: one step, one round, at any factor
            run_in_threads(*(lambda peer=peer: peer.step(batch_size=peer.tracker.target_batch_size)
                             for peer in peers))
            assert [peer.local_epoch for peer in peers] == [round_index + 1] * 2
            for mine, theirs in zip(models[0].parameters(), models[1].parameters()):
                assert torch.equal(mine.detach(), theirs.detach()), f"apart after round {round_index}"
            assert all(torch.equal(a, b) for a, b in zip(peers[0].global_params, peers[1].global_params))

        assert [(r.outcome, r.group_size) for r in reports] == [("ok", 2)] * (2 * ROUNDS)
        factors = [{length.epoch: length.factor for length in seen} for seen in lengths]
        # epoch 1 is the first the budgeted peer times (it began with its own round): it asks as it enters epoch 2
        first_long = 2 + LEAD_EPOCHS
        assert factors[0] == factors[1] == {epoch: 1 if epoch < first_long else 2 for epoch in range(ROUNDS + 1)}
        assert [peer.tracker.target_batch_size for peer in peers] == [8, 8]
        budgeted, other = lengths[0][-1], lengths[1][-1]
        assert (budgeted.requested, budgeted.meets_budget, budgeted.budget_mbit) == (2, False, 1e-6)
        assert (other.requested, other.meets_budget, other.budget_mbit) == (1, True, None)
        unmet = [record.getMessage() for record in caplog.records if "even at the longest round" in record.getMessage()]
        assert len(unmet) == 1 and "--max-round-factor 2" in unmet[0] and "--grad-compression int4" in unmet[0]
    finally:
        for peer in peers:
            peer.shutdown()
        for dht in dhts:
            dht.shutdown()
