"""A hostile peer in a 4-peer swarm: its contributions are dropped at the reducers, it is excluded, and the
three honest peers train on, equal to each other, with a falling validation loss."""
from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest
import torch

from tests.peers import load_model_state, max_parameter_difference, start_peer

MALICIOUS_TASK = "tests.tasks_for_tests:make_malicious_task"
ATTACK_FACTORS = {"nan": "nan", "scaled-1e4": "1e4", "sign-flipped": "-1"}
HONEST = ("a", "b", "c")
EPOCHS = 10


@pytest.mark.integration
@pytest.mark.timeout(300)
@pytest.mark.parametrize("attack", ATTACK_FACTORS)
def test_honest_peers_drop_then_exclude_a_malicious_peer_and_train_on(spawn, tmp_path: Path, attack: str):
    # bytelm-tiny fits in one all-reduce part, so each round has one reducer, a random member of the group:
    # a peer judges the attacker in about a quarter of the rounds, hence two judged offences to exclude it
    common = ("--target-batch-size", "48", "--min-peers", "4", "--exclude-after", "2")
    first = start_peer(spawn, tmp_path, "a", *common, "--max-epochs", str(EPOCHS))
    address = first.join_address()
    honest = [first] + [start_peer(spawn, tmp_path, name, *common, "--max-epochs", str(EPOCHS),
                                   "--initial-peers", address) for name in HONEST[1:]]
    attacker = start_peer(spawn, tmp_path, "attacker", *common, "--task", MALICIOUS_TASK, "--max-seconds", "240",
                          "--initial-peers", address, env={"ATTACK_FACTOR": ATTACK_FACTORS[attack]})
    for peer in honest:
        assert peer.wait(240) == 0, peer.log()[-3000:]
    attacker.send(signal.SIGTERM)
    assert attacker.wait(60) in (0, 1), attacker.log()[-3000:]  # 1: a NaN attacker diverges on its own

    attacker_id = re.search(r"peer id (\S+);", attacker.log()).group(1)
    summaries = [json.loads((tmp_path / f"{name}.json").read_text()) for name in HONEST]
    excluded = {peer for summary in summaries for peer in summary["excluded_peers"]}
    assert excluded == {attacker_id}, excluded  # the attacker, and never an honest peer
    assert f"excluding peer {attacker_id}" in "".join(peer.log() for peer in honest)
    states = [load_model_state(tmp_path / name) for name in HONEST]
    for state in states:
        assert all(bool(torch.isfinite(tensor).all()) for tensor in state.values())
    for state in states[1:]:
        assert max_parameter_difference(states[0], state) <= 1e-4
    for summary in summaries:
        assert summary["global_epoch"] >= EPOCHS
        assert summary["val_loss_last"] < summary["val_loss_first"], summary
