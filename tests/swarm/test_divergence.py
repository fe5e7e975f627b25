"""A peer whose loss stays NaN/Inf stops with a clear error instead of spinning over skipped batches."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from peer.testing import Swarm

DIVERGED = re.compile(r"non-finite for 20 batches in a row \(last: non-finite loss \((nan|inf|-inf)\)\): "
                      r"training diverged")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("task", ["tests.tasks_for_tests:make_nan_loss_task",
                                  "tests.tasks_for_tests:make_diverging_task"])
async def test_a_lone_peer_whose_loss_stays_nonfinite_stops_with_one_clear_error(tmp_path: Path, task):
    async with Swarm(tmp_path, "--task", task, "--target-batch-size", "16", "--metrics-port", "off",
                     fast=True) as swarm:
        peer = await swarm.add(ready=False)
        exited = await peer.exited(timeout=100)
    assert (exited.code, exited.reason) == (1, "diverged"), peer.log_tail()
    log = peer.log()  # the error a person reads: one line, no traceback
    errors = [line for line in log.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and DIVERGED.search(errors[0]), log[-3000:]
    assert "Traceback" not in log
    assert log.count("non-finite loss") <= 2  # one warning per streak, not one per batch
    summary = json.loads((tmp_path / "peer-0.json").read_text())
    assert summary["exit_reason"] == "diverged"
    assert summary["nonfinite_batches"] >= 20
    assert not list(peer.checkpoint_dir.glob("checkpoint-*"))  # diverged weights are not checkpointed
