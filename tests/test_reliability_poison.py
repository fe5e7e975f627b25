"""A clumsy peer's own NaN gradients are dropped before they reach a round (a malicious peer that sends
them anyway: tests/test_reliability_hostile.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.peers import load_model_state, start_peer

POISONED_TASK = "tests.tasks_for_tests:make_nan_gradients_task"


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_nan_gradients_are_dropped_by_their_own_peer_and_training_goes_on(spawn, tmp_path: Path):
    epochs = 6

    def start(name: str, task: str, *extra: str):
        return start_peer(spawn, tmp_path, name, "--task", task, "--target-batch-size", "48", "--min-peers", "2",
                          "--max-epochs", str(epochs), *extra, env={"POISON": "own"})

    honest = start("honest", "bytelm-tiny")
    clumsy = start("clumsy", POISONED_TASK, "--initial-peers", honest.join_address())
    for peer in (honest, clumsy):
        assert peer.wait(200) == 0, peer.log()[-3000:]

    assert "non-finite gradients in this batch: dropped" in clumsy.log()
    for name in ("honest", "clumsy"):
        summary = json.loads((tmp_path / f"{name}.json").read_text())
        assert summary["global_epoch"] >= epochs
        assert summary["dropped_contributions"] == 0  # nothing non-finite was ever sent
        state = load_model_state(tmp_path / name)
        assert all(bool(torch.isfinite(tensor).all()) for tensor in state.values()), name
