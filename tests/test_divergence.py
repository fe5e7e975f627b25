"""A peer whose loss stays NaN/Inf stops with a clear error instead of spinning over skipped batches."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.peers import FAST_SWARM_ARGS

DIVERGED = re.compile(r"non-finite for 20 batches in a row \(last: non-finite loss \((nan|inf|-inf)\)\): "
                      r"training diverged")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("task", ["tests.tasks_for_tests:make_nan_loss_task",
                                  "tests.tasks_for_tests:make_diverging_task"])
def test_a_lone_peer_whose_loss_stays_nonfinite_stops_with_one_clear_error(spawn, tmp_path: Path, task):
    summary_path = tmp_path / "summary.json"
    peer = spawn("peer", "start", *FAST_SWARM_ARGS, "--task", task, "--target-batch-size", "16",
                 "--metrics-port", "off", "--checkpoint-dir", str(tmp_path / "ckpt"),
                 "--summary-json", str(summary_path))
    assert peer.wait(100) == 1, peer.log()[-3000:]
    log = peer.log()
    errors = [line for line in log.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and DIVERGED.search(errors[0]), log[-3000:]
    assert "Traceback" not in log
    assert log.count("non-finite loss") <= 2  # one warning per streak, not one per batch
    summary = json.loads(summary_path.read_text())
    assert summary["exit_reason"] == "diverged"
    assert summary["nonfinite_batches"] >= 20
    assert not list((tmp_path / "ckpt").glob("*.pt"))  # diverged weights are not checkpointed
