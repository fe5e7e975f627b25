"""--swarm-key: a peer with the wrong secret cannot join a round, and the others keep training."""
from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from dht.swarm_key import SwarmKeyError, read_swarm_key, training_namespace
from tests.peers import epochs_in, load_model_state, max_parameter_difference, start_peer, wait_until


def test_namespace_depends_on_the_secret(tmp_path: Path):
    key_a, key_b = tmp_path / "a.key", tmp_path / "b.key"
    key_a.write_text("0123456789abcdef-secret-a\n")
    key_b.write_text("0123456789abcdef-secret-b\n")
    assert training_namespace("run", None) == "run"
    assert training_namespace("run", key_a) == training_namespace("run", key_a)
    assert training_namespace("run", key_a) != training_namespace("run", key_b)
    assert "secret" not in training_namespace("run", key_a)


def test_short_or_missing_key_is_a_clear_error(tmp_path: Path):
    short = tmp_path / "short.key"
    short.write_text("tiny")
    with pytest.raises(SwarmKeyError, match="fewer than 16"):
        read_swarm_key(short)
    with pytest.raises(SwarmKeyError, match="cannot read swarm key"):
        read_swarm_key(tmp_path / "missing.key")


@pytest.mark.integration
@pytest.mark.timeout(200)
def test_peer_with_wrong_key_cannot_join_a_round(spawn, tmp_path: Path):
    good, bad = tmp_path / "good.key", tmp_path / "bad.key"
    good.write_text("a-shared-secret-for-the-swarm")
    bad.write_text("somebody-elses-secret-entirely")
    epochs = 6

    def start(name: str, key: Path, *extra: str):
        return start_peer(spawn, tmp_path, name, "--target-batch-size", "32", "--max-epochs", str(epochs),
                          "--swarm-key", str(key), *extra)

    first = start("a", good, "--min-peers", "2")
    address = first.join_address()
    intruder = start("intruder", bad, "--initial-peers", address, "--max-seconds", "60")
    second = start("b", good, "--min-peers", "2", "--initial-peers", address)
    for peer in (first, second):
        assert peer.wait(150) == 0, peer.log()[-3000:]

    a, b = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("a", "b"))
    for summary in (a, b):
        assert summary["global_epoch"] == epochs
        assert summary["averaging_rounds"]["ok"] >= 1
        assert summary["largest_group"] == 2  # never three: the intruder was never in a group
    assert max_parameter_difference(load_model_state(tmp_path / "a"), load_model_state(tmp_path / "b")) <= 1e-5

    assert intruder.wait(90) == 0, intruder.log()[-3000:]
    stranger = json.loads((tmp_path / "intruder.json").read_text())
    assert stranger["averaging_rounds"]["ok"] == 0 and stranger["largest_group"] == 0


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_peers_with_another_task_target_or_strategy_are_refused_and_the_swarm_trains_on(spawn, tmp_path: Path):
    """The run manifest: each mismatched peer exits 2 naming the setting, before it can join a round."""
    honest = start_peer(spawn, tmp_path, "honest", "--target-batch-size", "32", "--max-seconds", "180")
    address = honest.join_address()
    mismatched = {
        "task": (["--task", "bytelm", "--target-batch-size", "32"], "--task is 'bytelm' here but 'bytelm-tiny'"),
        "target": (["--target-batch-size", "512"], "--target-batch-size is 512 here but 32 in the swarm"),
        "strategy": (["--averaging", "local-sgd", "--target-batch-size", "32"], "--averaging is 'local-sgd' here"),
    }
    peers = {name: start_peer(spawn, tmp_path, name, "--initial-peers", address, *args)
             for name, (args, _) in mismatched.items()}
    for name, (_, expected) in mismatched.items():
        assert peers[name].wait(120) == 2, peers[name].log()[-3000:]
        errors = [line for line in peers[name].log().splitlines() if line.startswith("error: ")]
        assert errors[0].startswith("error: " + expected), errors
        assert "use a new --run-id" in errors[-1]
        assert "Traceback" not in peers[name].log()
    epochs_then = epochs_in(honest.log())
    wait_until(lambda: epochs_in(honest.log()) >= epochs_then + 2, 90, message="the honest peer to train on")
    honest.send(signal.SIGTERM)
    assert honest.wait(60) == 0, honest.log()[-3000:]
    summary = json.loads((tmp_path / "honest.json").read_text())
    # it never averaged with, nor downloaded from, a mismatched peer: its parameters are its own
    assert summary["averaging_rounds"]["ok"] == 0 and summary["largest_group"] == 0
    assert summary["state_downloads"] == 0
