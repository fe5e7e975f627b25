"""Poisoned updates: NaN gradients from one peer never reach another peer's weights."""
from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch

from tests.peers import load_model_state, start_peer

POISONED_TASK = "tests.tasks_for_tests:make_nan_gradients_task"


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_nan_gradients_are_dropped_or_discarded_and_training_goes_on(spawn, tmp_path: Path):
    epochs = 6

    def start(name: str, task: str, poison: str, *extra: str):
        return start_peer(spawn, tmp_path, name, "--task", task, "--target-batch-size", "48", "--min-peers", "3",
                          *extra, env={"POISON": poison})

    honest = start("honest", "bytelm-tiny", "", "--max-epochs", str(epochs))
    address = honest.join_address()
    clumsy = start("clumsy", POISONED_TASK, "own", "--max-epochs", str(epochs), "--initial-peers", address)
    malicious = start("malicious", POISONED_TASK, "send", "--max-seconds", "150", "--initial-peers", address)
    for peer in (honest, clumsy):
        assert peer.wait(200) == 0, peer.log()[-3000:]
    malicious.send(signal.SIGTERM)  # it would poison rounds for ever: stop it once the others are done
    assert malicious.wait(60) in (0, 1), malicious.log()[-3000:]  # 1: it diverged on its own NaN gradients

    assert "non-finite gradients in this batch: dropped" in clumsy.log()
    assert "hold NaN or Inf" in honest.log() + clumsy.log()  # the malicious peer's rounds were caught
    for name in ("honest", "clumsy"):
        summary = json.loads((tmp_path / f"{name}.json").read_text())
        # the malicious peer runs on past `epochs`, so a peer may download a later state while it finishes
        assert summary["global_epoch"] >= epochs
        assert summary["averaging_rounds"]["failed"] >= 1
        state = load_model_state(tmp_path / name)
        assert all(bool(torch.isfinite(tensor).all()) for tensor in state.values()), name
