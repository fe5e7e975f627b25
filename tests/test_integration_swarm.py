"""Real swarms of `peer` processes on 127.0.0.1, training the built-in task (tiny size)."""
from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from peer.events import EpochEnded, Exited, RoundEnded, StateDownloaded
from peer.testing import Swarm, max_parameter_difference
from tests.peers import FAST_SWARM_ARGS, load_model_state, session_processes, start_peer, wait_until

pytestmark = pytest.mark.integration


def read_summary(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.mark.timeout(240)
def test_three_peers_train_in_lock_step(spawn, tmp_path: Path):
    epochs = 16
    swarm = spawn(
        "swarm", "swarm", "--peers", "3", *FAST_SWARM_ARGS,
        "--min-peers", "3", "--target-batch-size", "48", "--max-epochs", str(epochs),
        "--checkpoint-dir", str(tmp_path / "ckpt"), "--summary-dir", str(tmp_path / "summaries"),
    )
    assert swarm.wait(200) == 0, swarm.log()[-4000:]

    summaries = [read_summary(tmp_path / "summaries" / f"peer-{i}.json") for i in range(3)]
    for summary in summaries:
        assert summary["exit_reason"] == "max_epochs"
        assert summary["global_epoch"] == epochs
        assert summary["averaging_rounds"]["ok"] >= epochs // 2, summary["averaging_rounds"]
        assert summary["val_loss_last"] <= 0.7 * summary["val_loss_first"], summary
        assert summary["phase_seconds"]["forward"] > 0 and summary["phase_seconds"]["averaging"] > 0
    states = [load_model_state(tmp_path / "ckpt" / f"peer-{i}") for i in range(3)]
    assert max_parameter_difference(states[0], states[1]) <= 1e-5
    assert max_parameter_difference(states[0], states[2]) <= 1e-5


@pytest.mark.timeout(150)
async def test_a_peer_that_finishes_first_stays_until_a_straggler_has_the_final_state(tmp_path: Path):
    """The straggler stalls after epoch 2 for longer than the averaging timeout (an injected fault), so it misses
    the last round: the first peer ends that round alone, must stay while the straggler is behind, and serve it the
    final state."""
    epochs, timeout = 3, 5
    stall = json.dumps({"stall_after_epoch": epochs - 1, "stall_seconds": timeout + 4})
    async with Swarm(tmp_path, "--task", "bytelm-tiny", "--min-peers", "2", "--target-batch-size", "32",
                     "--max-epochs", str(epochs), fast=True) as swarm:
        first = await swarm.add("--averaging-timeout-seconds", str(timeout))
        straggler = await swarm.add("--averaging-timeout-seconds", str(timeout), "--inject-faults", stall)
        assert await swarm.all_exited(timeout=90) == [0, 0]

        rounds = [event.outcome for event in first.events if isinstance(event, RoundEnded)]
        assert "failed" in rounds or "timeout" in rounds, rounds
        # nobody else had reached the last epoch: its own state is the final one, with nothing to download
        assert not any(isinstance(event, StateDownloaded) for event in first.events)
        downloads = [event.epoch for event in straggler.events if isinstance(event, StateDownloaded)]
        assert downloads and downloads[-1] == epochs, downloads
        exited = straggler.events[-1]
        assert straggler.epoch == epochs and isinstance(exited, Exited) and exited.reason == "max_epochs"
        assert max_parameter_difference(first.model_state(), straggler.model_state()) <= 1e-5


@pytest.mark.timeout(300)
def test_late_joiner_downloads_state_then_restart_resumes_from_checkpoint(spawn, tmp_path: Path):
    epochs = 20

    def start(name: str, *extra: str):
        return start_peer(spawn, tmp_path, name, "--target-batch-size", "32", "--max-epochs", str(epochs),
                          "--checkpoint-every-epochs", "1", *extra)

    first = start("a", "--min-peers", "2")
    address = first.join_address()
    second = start("b", "--min-peers", "2", "--initial-peers", address)
    wait_until(lambda: first.epoch() >= 4, 120, message="the first two peers to reach epoch 4")

    late = start("c", "--initial-peers", address)
    wait_until(lambda: any(isinstance(event, StateDownloaded) for event in late.events()), 90,
               message="the late joiner to download state")
    wait_until(lambda: sum(isinstance(event, EpochEnded) for event in late.events()) >= 2, 60,
               message="the late joiner to train two epochs")

    late.send(signal.SIGTERM)
    assert late.wait(30) == 0, late.log()[-3000:]
    stopped = read_summary(tmp_path / "c.json")
    assert stopped["exit_reason"] == "signal:SIGTERM"
    assert stopped["state_downloads"] >= 1

    checkpoints = sorted((tmp_path / "c").glob("checkpoint-*.pt"))
    assert len(checkpoints) >= 2
    newest = checkpoints[-1]
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # a torn write

    restarted = start("c-again", "--initial-peers", address, "--checkpoint-dir", str(tmp_path / "c"))
    for peer in (first, second, restarted):
        assert peer.wait(200) == 0, peer.log()[-4000:]
    log = restarted.log()
    assert f"skipping checkpoint {newest}" in log, log[-3000:]
    assert f"resumed from {checkpoints[-2]}" in log

    summaries = [read_summary(tmp_path / f"{name}.json") for name in ("a", "b", "c-again")]
    assert [s["global_epoch"] for s in summaries] == [epochs] * 3
    assert summaries[2]["resumed_from"] == str(checkpoints[-2])
    states = [load_model_state(tmp_path / name) for name in ("a", "b", "c")]
    assert max_parameter_difference(states[0], states[1]) <= 1e-5
    assert max_parameter_difference(states[0], states[2]) <= 1e-5


@pytest.mark.timeout(180)
def test_sigint_saves_checkpoint_and_restart_resumes(spawn, tmp_path: Path):
    args = ["start", *FAST_SWARM_ARGS, "--target-batch-size", "16", "--checkpoint-dir", str(tmp_path / "ckpt"),
            "--checkpoint-every-epochs", "1000", "--summary-json", str(tmp_path / "summary.json")]
    peer = spawn("peer", *args)
    wait_until(lambda: peer.epoch() >= 3, 90, message="three epochs")
    peer.send(signal.SIGINT)
    assert peer.wait(30) == 0, peer.log()[-3000:]
    first = read_summary(tmp_path / "summary.json")
    assert first["exit_reason"] == "signal:SIGINT"
    assert len(list((tmp_path / "ckpt").glob("checkpoint-*.pt"))) == 1  # written on shutdown
    assert "Traceback" not in peer.log()

    again = spawn("again", *args, "--max-epochs", str(first["global_epoch"] + 2))
    assert again.wait(90) == 0, again.log()[-3000:]
    second = read_summary(tmp_path / "summary.json")
    assert second["resumed_from"] is not None
    assert second["global_epoch"] == first["global_epoch"] + 2
    assert second["local_steps"] > first["local_steps"]


@pytest.mark.timeout(120)
def test_sigkill_leaves_no_orphans(spawn):
    peer = spawn("peer", "start", *FAST_SWARM_ARGS, "--target-batch-size", "16", "--data-workers", "2")
    wait_until(lambda: peer.epoch() >= 1, 90, message="the first epoch")
    children = peer.descendants()
    assert any("p2pd" in " ".join(child.cmdline()) for child in children), "expected a p2pd child"
    assert len(children) >= 4  # DHT process, p2pd, two averagers, data workers

    peer.send(signal.SIGKILL)
    peer.wait(10)
    wait_until(lambda: not session_processes(peer.pid), 15, message="every child of the killed peer to exit")
