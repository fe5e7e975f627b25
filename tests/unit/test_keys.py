"""dht/keys.py names every DHT key and averager prefix, and hivemind derives the same names from the prefix."""
from __future__ import annotations

import hivemind
import pytest
import torch

from averaging.api import Replica
from averaging.config import AveragingConfig
from averaging.strategies.factory import build_swarm_optimizer
from dht.keys import SwarmKeys


def test_without_a_swarm_key_every_training_key_is_prefixed_by_the_run_id():
    keys = SwarmKeys.for_run("run")
    assert keys.namespace == "run"
    assert (keys.peers, keys.progress, keys.start_gate, keys.leaving) == (
        "run_peers", "run_progress", "run_progress_start", "run_progress_leaving")
    assert (keys.state_averager, keys.grad_averager, keys.diloco_state, keys.diloco_outer) == (
        "run_state_averager", "run_grad_averager", "run_diloco_state", "run_diloco_outer")


def test_a_swarm_key_moves_every_training_key_but_not_the_open_peer_records(tmp_path):
    secret = tmp_path / "swarm.key"
    secret.write_text("a-shared-secret-for-the-swarm")
    keyed, open_ = SwarmKeys.for_run("run", secret), SwarmKeys.for_run("run")
    assert keyed.peers == open_.peers  # status and the monitor list peers with the run id alone
    for name in ("progress", "start_gate", "leaving", "state_averager", "grad_averager", "diloco_state",
                 "diloco_outer", "round_factors"):
        assert getattr(keyed, name) != getattr(open_, name) and getattr(keyed, name).startswith("run-")
    assert "." not in keyed.namespace  # hivemind forbids dots in prefixes


@pytest.mark.timeout(120)
def test_hivemind_derives_the_same_names_as_the_registry():
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    optimizer = None
    try:
        keys = SwarmKeys.for_run("names")
        optimizer = build_swarm_optimizer(
            AveragingConfig(target_batch_size=8, matchmaking_seconds=1.0, averaging_timeout_seconds=5.0),
            Replica(dht=dht, keys=keys, params=torch.nn.Linear(2, 1).parameters(),
                    optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1), client_mode=False),
        )
        assert optimizer.tracker.training_progress_key == keys.progress
        assert optimizer.grad_averager.prefix == keys.grad_averager
        assert optimizer.state_averager.prefix == keys.state_averager
    finally:
        if optimizer is not None:
            optimizer.shutdown()
        dht.shutdown()
