"""A clumsy peer's own NaN gradients are dropped before they reach a round (a malicious peer that sends
them anyway: tests/reliability/test_hostile.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from peer.telemetry.events import RoundEnded
from peer.testing import Swarm

# every third batch has NaN gradients and a finite loss: hivemind discards a batch unchecked when the peer is
# out of sync, so only some of them reach the guard, but many do
POISON = json.dumps({"nan_gradients_at_steps": list(range(3, 300, 3))})


@pytest.mark.timeout(240)
async def test_nan_gradients_are_dropped_by_their_own_peer_and_training_goes_on(tmp_path: Path):
    epochs = 6
    async with Swarm(tmp_path, "--task", "bytelm-tiny", "--target-batch-size", "48", "--min-peers", "2",
                     "--max-epochs", str(epochs), fast=True) as swarm:
        honest = await swarm.add(name="honest")
        clumsy = await swarm.add("--inject-faults", POISON, name="clumsy")
        assert await swarm.all_exited(timeout=200) == [0, 0]

        assert "non-finite gradients in this batch: dropped" in clumsy.log()
        for peer in (honest, clumsy):
            summary = json.loads((tmp_path / f"{peer.name}.json").read_text())
            assert summary["global_epoch"] >= epochs
            assert summary["dropped_contributions"] == 0  # nothing non-finite was ever sent
            assert any(event.outcome == "ok" for event in peer.events if isinstance(event, RoundEnded))
            assert all(bool(torch.isfinite(tensor).all()) for tensor in peer.model_state().values()), peer.name
