"""A peer whose checkpoint disk fills up mid-run keeps training with its swarm (a real 2-peer swarm, a real tmpfs)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from peer.telemetry.events import CheckpointWritten
from peer.testing import Swarm, load_model_state, max_parameter_difference
from tests.peers import free_port, tmpfs

EPOCHS = 5
FULL_FROM_EPOCH, FREED_AT_EPOCH = 2, 4  # the checkpoints of epochs 2 and 3 fail


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 4 MiB tmpfs (room for one bytelm-tiny checkpoint and the temp file of the next), unmounted afterwards."""
    mount_point = tmp_path / "small-disk"
    mount_point.mkdir()
    with tmpfs(mount_point, "4m"):
        yield mount_point


@pytest.mark.timeout(180)
async def test_a_peer_whose_disk_fills_mid_run_trains_on_with_its_swarm(tmp_path: Path, small_disk: Path):
    """Deterministic by construction: the failing peer fills its own disk with a ballast file just before its
    checkpoint of epoch 2 and deletes it just before the one of epoch 4 (tests/tasks_for_tests.py), so exactly the
    checkpoints of epochs 2 and 3 fail, whatever the timing, and its final checkpoint works: the parameters both
    peers end with can be compared from their final checkpoints. The peer also records its own /healthz and
    failure counter while its disk is full and after, at those same points."""
    async with Swarm(tmp_path, "--task", "tests.tasks_for_tests:make_checkpoint_fault_task", "--min-peers", "2",
                     "--target-batch-size", "32", "--max-epochs", str(EPOCHS), "--checkpoint-every-epochs", "1",
                     fast=True) as swarm:
        healthy = await swarm.add(name="healthy")
        probes = tmp_path / "probes.jsonl"
        port = str(free_port())  # the task probes its own /healthz there (PEER_METRICS_PORT)
        full = await swarm.add("--checkpoint-dir", str(small_disk), "--keep-checkpoints", "1", "--metrics-port", port,
                               name="full", env={
                                   "DISK_BALLAST": str(small_disk / "ballast"), "FULL_FROM_EPOCH": str(FULL_FROM_EPOCH),
                                   "FREED_AT_EPOCH": str(FREED_AT_EPOCH), "PEER_METRICS_PORT": port,
                                   "PROBE_RECORD": str(probes)})
        assert await swarm.all_exited(timeout=150) == [0, 0]

    summary = json.loads((tmp_path / "full.json").read_text())
    assert (summary["exit_reason"], summary["global_epoch"]) == ("max_epochs", EPOCHS)
    assert summary["checkpoint_failures"] == FREED_AT_EPOCH - FULL_FROM_EPOCH
    assert summary["averaging_rounds"]["ok"] >= 1, summary  # it averaged with its swarm
    checkpoints = [event for event in full.events if isinstance(event, CheckpointWritten)]
    assert [event.epoch for event in checkpoints if not event.ok] == [FULL_FROM_EPOCH, FREED_AT_EPOCH - 1]
    assert all("No space left on device (ENOSPC)" in event.problem for event in checkpoints if not event.ok)
    assert checkpoints[-1].ok and checkpoints[-1].epoch == EPOCHS
    log = full.log()  # what a person reads: one warning while the disk is full, one line when it recovers
    warnings = [line for line in log.splitlines() if "checkpoint failed:" in line]
    assert len(warnings) == 1 and "No space left on device (ENOSPC)" in warnings[0], warnings
    assert log.count("checkpoints work again") == 1 and "Traceback" not in log
    while_full, after = [json.loads(line) for line in probes.read_text().splitlines()]
    assert while_full["healthz"][0] == 503 and "checkpoints failing since epoch 2" in while_full["healthz"][1]
    assert while_full["checkpoint_failures"] == 2
    assert after == {"healthz": [200, "ok\n"], "checkpoint_failures": 2}

    assert [path.name for path in small_disk.glob("checkpoint-*")] == [Path(summary["last_checkpoint"]).name]
    assert max_parameter_difference(healthy.model_state(), load_model_state(small_disk)) <= 1e-5
