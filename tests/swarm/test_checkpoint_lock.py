"""One peer per --checkpoint-dir, with real peers: a second `peer start` on a busy directory exits 2 at once, naming
the first one's pid, while the first trains on with its checkpoints untouched (the lock itself:
tests/inprocess/test_checkpoint_lock.py)."""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from peer.telemetry.events import Ready
from peer.testing import Swarm, until


def fingerprints(directory: Path) -> dict:
    """Each checkpoint's name -> the sha256 of all its parts (a checkpoint is a directory of them)."""
    return {path.name: hashlib.sha256(b"".join(part.read_bytes() for part in sorted(path.iterdir()))).hexdigest()
            for path in directory.glob("checkpoint-*")}


@pytest.mark.timeout(150)
async def test_a_second_peer_on_a_busy_checkpoint_dir_exits_2_and_the_first_trains_on_untouched(tmp_path):
    # --keep-checkpoints 100000: the first peer prunes nothing, so every file it had must still be there,
    # unchanged (alone, it writes several checkpoints a second: 100 were pruned under suite load once)
    async with Swarm(tmp_path, "--task", "bytelm-tiny", "--target-batch-size", "16", fast=True) as swarm:
        first = await swarm.add("--checkpoint-every-epochs", "1", "--keep-checkpoints", "100000", name="a")
        await until(lambda: len(fingerprints(first.checkpoint_dir)) >= 2, 90, "the first peer's first two checkpoints")
        before = fingerprints(first.checkpoint_dir)

        second = await swarm.add("--checkpoint-dir", str(first.checkpoint_dir), name="b", ready=False)
        exited = await second.exited(timeout=60)
        assert exited.code == 2, second.log_tail()

        output = second.log()  # the one line a person reads
        errors = [line for line in output.splitlines() if line.startswith("error: ")]
        busy = first.checkpoint_dir
        assert errors == [f"error: --checkpoint-dir {busy} is in use by another peer (pid {first.pid}): two peers on "
                          f"one directory resume from the same checkpoint and prune each other's; stop that peer, or "
                          f"give this one its own directory with --checkpoint-dir"], output[-3000:]
        assert "Traceback" not in output
        assert not [event for event in second.events if isinstance(event, Ready)]  # it left before joining anything
        newest = max(before)
        await until(lambda: max(fingerprints(busy)) > newest, 60, "a later checkpoint of the first peer")
        first.terminate()
        assert await first.exit_code(timeout=30) == 0, first.log_tail()
    after = fingerprints(first.checkpoint_dir)
    assert {name: after.get(name) for name in before} == before
    assert not (tmp_path / "b.json").exists()  # the refused peer wrote no summary either
