"""Real swarms of `peer` processes on 127.0.0.1, training the built-in task (tiny size)."""
from __future__ import annotations

import asyncio
import itertools
import json
import shlex
import signal
from collections import Counter
from pathlib import Path

import pytest

from peer.tasks import load_task
from peer.tasks.order import DataOrder
from peer.telemetry.events import EpochEnded, Exited, RoundEnded, StateDownloaded, read_events
from peer.testing import FAST_ENV, Swarm, load_model_state, max_parameter_difference
from tests.peers import FAST_SWARM_ARGS


def read_summary(path: Path) -> dict:
    return json.loads(path.read_text())


def entered_by_averaging(events) -> list:
    """The epochs a peer entered through a gradient round it averaged in (ok or partial): its last round before each
    EpochEnded."""
    entered, last_round = [], None
    for event in events:
        if isinstance(event, RoundEnded):
            last_round = event
        elif isinstance(event, EpochEnded):
            if last_round is not None and last_round.outcome in ("ok", "partial"):
                entered.append(event.epoch)
            last_round = None
    return entered


@pytest.mark.timeout(240)
async def test_three_peers_train_in_lock_step(tmp_path: Path):
    """`peer swarm`, as a user runs it: three peers that train together from the first round (it waits for all of
    them by default) and end with one set of weights; only the first prints how to join."""
    epochs = 16
    async with Swarm(tmp_path, env=FAST_ENV) as harness:  # `peer swarm` passes it on
        swarm = harness.run(
            "swarm", "--peers", "3", *FAST_SWARM_ARGS, "--target-batch-size", "48", "--max-epochs", str(epochs),
            "--checkpoint-dir", str(tmp_path / "ckpt"), "--summary-dir", str(tmp_path / "summaries"), name="swarm",
        )
        assert await swarm.exit_code(timeout=200) == 0, swarm.log_tail(4000)
        hints = [line for line in swarm.log().splitlines() if "To join this swarm" in line]
        assert len(hints) == 1 and hints[0].startswith("[peer-0]"), hints

    summaries = [read_summary(tmp_path / "summaries" / f"peer-{i}.json") for i in range(3)]
    for summary in summaries:
        assert summary["exit_reason"] == "max_epochs"
        assert summary["global_epoch"] == epochs
        assert summary["phase_seconds"]["forward"] > 0 and summary["phase_seconds"]["averaging"] > 0
    averaged_into = Counter()  # epoch -> peers that entered it through a round they averaged in
    for index, summary in enumerate(summaries):
        events, _ = read_events(tmp_path / "ckpt" / f"peer-{index}.events.jsonl")
        # it learned: the best validation of the run, not the last one alone (bytelm-tiny at a target batch of 48
        # spikes: seen in CI, 3.47-3.50 at epochs 11-15, 3.92 at 16, with the three peers' states equal)
        best = min(event.val_loss for event in events if isinstance(event, EpochEnded) and event.val_loss is not None)
        assert best <= 0.7 * summary["val_loss_first"], (best, summary)
        first_round = next(event for event in events if isinstance(event, RoundEnded))
        assert first_round.outcome != "skipped", (index, first_round)  # nobody trained alone first
        averaged_into.update(entered_by_averaging(events))
    # the swarm trained together at every epoch; a peer that the others left behind under load (its machine
    # starved, or its first round partial) may enter a few epochs by downloading their state instead (seen in CI)
    assert all(averaged_into[epoch] >= 2 for epoch in range(1, epochs + 1)), averaged_into
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
    # no parameter rounds: the one of the last transition (which a checked peer finishes within its step) would
    # make the two states equal before either leaves, and the leaving protocol would have nothing to settle
    async with Swarm(tmp_path, "--task", "bytelm-tiny", "--min-peers", "2", "--target-batch-size", "32",
                     "--max-epochs", str(epochs), "--average-state-every", "1000", fast=True) as swarm:
        first = await swarm.add("--averaging-timeout-seconds", str(timeout))
        straggler = await swarm.add("--averaging-timeout-seconds", str(timeout), "--inject-faults", stall)
        assert await swarm.all_exited(timeout=90) == [0, 0]

        rounds = [event.outcome for event in first.events if isinstance(event, RoundEnded)]
        assert "failed" in rounds or "timeout" in rounds, rounds
        # nobody else had reached the last epoch: its own state is the final one, with nothing to download (an
        # earlier epoch's partial round may have sent it to download the straggler's state: that is a resync)
        assert not any(isinstance(event, StateDownloaded) and event.epoch == epochs for event in first.events)
        downloads = [event.epoch for event in straggler.events if isinstance(event, StateDownloaded)]
        assert downloads and downloads[-1] == epochs, downloads
        exited = straggler.events[-1]
        assert straggler.epoch == epochs and isinstance(exited, Exited) and exited.reason == "max_epochs"
        assert max_parameter_difference(first.model_state(), straggler.model_state()) <= 1e-5


TINY = ("--task", "bytelm-tiny")
LATE_JOINER_EPOCHS = 80


@pytest.mark.timeout(300)
async def test_late_joiner_downloads_state_then_restart_resumes_from_checkpoint(tmp_path: Path):
    # enough epochs that the first two are still training when the late joiner is back from its restart (with
    # 20, and once with 32, under suite load, they had finished and its restart found nobody to join); only the
    # bound: the run ends a few epochs after the late joiner is back
    async with Swarm(tmp_path, *TINY, "--target-batch-size", "32", "--max-epochs", str(LATE_JOINER_EPOCHS),
                     "--checkpoint-every-epochs", "1", fast=True) as swarm:
        swarm.args += swarm.ends_on_request()
        first = await swarm.add("--min-peers", "2")
        second = await swarm.add("--min-peers", "2")
        await first.reach(4, timeout=120)

        late = await swarm.add(name="c")
        download = await late.wait_for(StateDownloaded, timeout=90, what="the late joiner to download state")
        await late.reach(download.epoch + 2, timeout=60)
        late.terminate()
        assert await late.exit_code(timeout=30) == 0
        stopped = read_summary(tmp_path / "c.json")
        assert stopped["exit_reason"] == "signal:SIGTERM"
        assert stopped["state_downloads"] >= 1

        checkpoints = sorted(late.checkpoint_dir.glob("checkpoint-*"))
        assert len(checkpoints) >= 2
        newest = checkpoints[-1]
        torn = newest / "model.safetensors"
        torn.write_bytes(torn.read_bytes()[: torn.stat().st_size // 2])  # a torn write

        await late.restart()
        await late.wait_for(StateDownloaded, timeout=90, what="the restarted peer to catch up with the swarm")
        epochs = min(LATE_JOINER_EPOCHS, swarm.end_soon([first, second, late]))  # --max-epochs still bounds it
        assert await swarm.all_exited(timeout=200) == [0, 0, 0]
        log = late.log()
        assert f"skipping checkpoint {newest}" in log, log[-3000:]
        assert f"resumed from {checkpoints[-2]}" in log

        summaries = [read_summary(tmp_path / f"{peer.name}.json") for peer in (first, second, late)]
        assert [s["global_epoch"] for s in summaries] == [epochs] * 3
        assert summaries[2]["resumed_from"] == str(checkpoints[-2])
        assert max_parameter_difference(first.model_state(), second.model_state()) <= 1e-5
        assert max_parameter_difference(first.model_state(), late.model_state()) <= 1e-5


@pytest.mark.timeout(180)
async def test_sigint_saves_checkpoint_and_restart_resumes(tmp_path: Path):
    async with Swarm(tmp_path, *TINY, "--target-batch-size", "16", "--checkpoint-every-epochs", "1000",
                     fast=True) as swarm:
        peer = await swarm.add()
        await peer.reach(3, timeout=90)
        peer.send(signal.SIGINT)
        assert await peer.exit_code(timeout=30) == 0
        first = read_summary(tmp_path / "peer-0.json")
        assert first["exit_reason"] == "signal:SIGINT"
        assert len(list(peer.checkpoint_dir.glob("checkpoint-*"))) == 1  # written on shutdown
        assert "Traceback" not in peer.log()

        await peer.restart("--max-epochs", str(first["global_epoch"] + 2))
        assert await peer.exit_code(timeout=90) == 0
        second = read_summary(tmp_path / "peer-0.json")
        assert second["resumed_from"] is not None
        assert second["global_epoch"] == first["global_epoch"] + 2
        assert second["local_steps"] > first["local_steps"]
        # it read on in its own order from where it stood, not from its first sample again
        assert second["data_seed"] == first["data_seed"]
        assert second["data_started_at_sample"] == first["samples"] > 0


@pytest.mark.timeout(180)
async def test_two_peers_started_with_the_printed_join_command_read_different_samples(tmp_path: Path):
    """The join command carries no seed: each peer draws its own data order (from its peer ID), so two volunteers
    who follow it never compute the same batches; they still end with one state."""
    epochs = ("--max-epochs", "3")
    async with Swarm(tmp_path, fast=True) as swarm:
        first = await swarm.add(*TINY, "--target-batch-size", "32", "--min-peers", "2", *epochs)
        lines = first.log().splitlines()
        hint = lines[next(index for index, line in enumerate(lines) if "To join this swarm" in line) + 1]
        command = shlex.split(hint.partition("peer start")[2])
        assert "--seed" not in command and "--initial-peers" in command, hint
        second = await swarm.add(*command, *epochs, join=False)
        assert await swarm.all_exited(timeout=120) == [0, 0]

        seeds = [read_summary(tmp_path / f"{peer.name}.json")["data_seed"] for peer in (first, second)]
        assert seeds[0] != seeds[1], seeds
        # the orders those seeds give: a peer reads exactly its order (tests/unit/test_trainer.py's resume test)
        samples = len(load_task("bytelm-tiny").build_train_dataset())
        orders = [list(itertools.islice(iter(DataOrder(samples, seed)), 64)) for seed in seeds]
        assert len(set(orders[0]) & set(orders[1])) < 8, orders  # two draws of 64 from thousands barely meet
        assert max_parameter_difference(first.model_state(), second.model_state()) <= 1e-5


@pytest.mark.timeout(120)
async def test_sigkill_leaves_no_orphans(tmp_path: Path):
    async with Swarm(tmp_path, *TINY, "--target-batch-size", "16", "--data-workers", "2", fast=True) as swarm:
        peer = await swarm.add()
        await peer.reach(1, timeout=90)
        children = [proc for proc in peer.session_processes() if proc.pid != peer.pid]
        assert any("p2pd" in " ".join(child.cmdline()) for child in children), "expected a p2pd child"
        assert len(children) >= 4  # DHT process, p2pd, two averagers, data workers
        # tensors are shared by descriptor (peer/process/tensor_sharing.py): no shared-memory manager
        assert not [child for child in children if child.name() == "torch_shm_manager"], children

        peer.send(signal.SIGKILL)  # the peer alone: its children must notice and exit by themselves
        await peer.exit_code(timeout=10)
        for _ in range(150):
            if not peer.session_processes():
                break
            await asyncio.sleep(0.1)
        assert not peer.session_processes(), "children of the killed peer outlived it"
