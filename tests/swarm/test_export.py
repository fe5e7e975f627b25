"""`peer export` on a real peer's checkpoints: while it trains (the directory is only read) and after it stopped,
when the export holds exactly the weights of its final checkpoint. The refusals, in this process:
tests/unit/test_export.py."""
from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

from benchmarks.common import child_env
from peer.checkpoint.store import read_newest
from peer.telemetry.events import CheckpointWritten
from peer.testing import Swarm

EXPORT_TIMEOUT_SECONDS = 120


async def peer_export(*args: str) -> subprocess.CompletedProcess:
    return await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "peer", "export", *args], env=child_env(),
                                   capture_output=True, text=True, timeout=EXPORT_TIMEOUT_SECONDS)


@pytest.mark.timeout(300)
async def test_peer_export_reads_a_training_peers_checkpoints_and_writes_their_weights_exactly(tmp_path: Path):
    async with Swarm(tmp_path, "--task", "bytelm-tiny", "--target-batch-size", "16", fast=True) as swarm:
        # a checkpoint every epoch, only the newest kept: the peer prunes under the export as it can
        peer = await swarm.add("--max-epochs", "100000", "--checkpoint-every-epochs", "1", "--keep-checkpoints", "1")
        await peer.wait_for(CheckpointWritten, lambda event: event.ok, timeout=90, what="its first checkpoint")

        during = await peer_export("--checkpoint-dir", str(peer.checkpoint_dir), "--out", str(tmp_path / "during"))

        assert during.returncode == 0, during.stderr
        exported_epoch = json.loads((tmp_path / "during" / "model.json").read_text())["global_epoch"]
        await peer.wait_for(CheckpointWritten, lambda event: event.ok and event.epoch > exported_epoch + 1,
                            timeout=60, what="checkpoints after the export: it trained on, its lock its own")
        peer.terminate()
        assert await peer.exit_code(timeout=60) == 0, peer.log_tail()
        assert "Traceback" not in peer.log()

    out = tmp_path / "exported"
    after = await peer_export("--checkpoint-dir", str(peer.checkpoint_dir), "--out", str(out))

    assert after.returncode == 0, after.stderr
    checkpoint, damaged = read_newest(peer.checkpoint_dir)
    assert damaged == [] and checkpoint.global_epoch > exported_epoch
    assert after.stdout == (f"exported {checkpoint.path.name} (task bytelm-tiny, run swarmtrain, global epoch "
                            f"{checkpoint.global_epoch}) to {out}: model.json, model.safetensors\n")
    weights = checkpoint.state["model"]
    tensors = safetensors.torch.load_file(out / "model.safetensors")
    assert sorted(tensors) == sorted(weights)
    for name, tensor in weights.items():
        assert tensors[name].dtype == tensor.dtype and torch.equal(tensors[name], tensor), name

    description = json.loads((out / "model.json").read_text())
    assert (description["task"], description["run_id"], description["global_epoch"]) == (
        "bytelm-tiny", "swarmtrain", checkpoint.global_epoch)
    assert description["checkpoint"] == {"path": str(checkpoint.path), "sha256": checkpoint.sha256}
    assert description["tensors"] == {name: {"shape": list(tensor.shape), "dtype": "float32", "kind": "parameter"}
                                      for name, tensor in weights.items()}
    tied_copies = sum(math.prod(description["tensors"][name]["shape"]) for group in description["tied"]
                      for name in group[1:])
    assert description["parameter_count"] == sum(tensor.numel() for tensor in weights.values()) - tied_copies

    again = await peer_export("--checkpoint-dir", str(peer.checkpoint_dir), "--out", str(out))
    assert again.returncode == 2 and again.stdout == "", again.stderr
    assert again.stderr == (f"error: --out {out} exists and is not empty; name a new or empty directory, or add "
                            f"--force to replace it\n")
