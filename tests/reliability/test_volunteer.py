"""A volunteer's machine stays theirs: `peer pause` and `peer resume` on a running peer of a 3-peer swarm, and
--yield-when-busy against a program that burns the CPU. Real peers on 127.0.0.1."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from peer.telemetry.events import EpochEnded, Paused, Resumed, RoundEnded, StateDownloaded
from peer.testing import Swarm, load_model_state, max_parameter_difference
from tests.http import get, scrape
from tests.peers import REPO_ROOT

TIMEOUT = 60.0


async def peer_command(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """Run `peer <args>` to completion, off the event loop (killed after TIMEOUT: the test then fails)."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "peer", *args], cwd=cwd, env=env,
                                   capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=TIMEOUT)


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/")[0])


@pytest.mark.timeout(420)
async def test_a_paused_peer_holds_up_no_round_counts_nothing_and_resumes_into_the_swarms_state(tmp_path: Path):
    async with Swarm(tmp_path, "--task", "bytelm-tiny", "--target-batch-size", "48", "--min-peers", "3",
                     "--max-epochs", "200", fast=True) as swarm:
        peers = await swarm.start(3, *swarm.ends_on_request())
        first, second, volunteer = peers
        await swarm.all_reached(2, timeout=120)

        done = await peer_command(tmp_path, "pause", "--checkpoint-dir", str(tmp_path / volunteer.name))
        assert done.returncode == 0 and "paused: the peer" in done.stdout, done.stdout + done.stderr
        paused = await volunteer.wait_for(Paused, timeout=5, what="the pause")
        assert paused.reasons == {"requested": "requested by peer pause"} and paused.parked_bytes == 0  # on a CPU
        status, body = get(port_of(volunteer.metrics_url), "/healthz")
        assert status == 200 and body.startswith("ok: paused: requested by peer pause"), body
        metrics = scrape(port_of(volunteer.metrics_url))
        assert metrics[("peer_paused", (("reason", "requested"),))] == 1
        samples_when_paused = metrics[("peer_samples_total", ())]

        # the other two train on, in groups of two: no round waits on the paused peer
        goal = max(first.epoch, second.epoch) + 4
        await swarm.all_reached(goal, timeout=180, peers=[first, second])
        for peer in (first, second):
            events = peer.events
            since = next(i for i, event in enumerate(events) if isinstance(event, EpochEnded)
                         and event.epoch >= paused.epoch + 2)  # past any round the volunteer was already in
            rounds = [event for event in events[since:] if isinstance(event, RoundEnded)]
            assert rounds and all(event.group_size <= 2 and event.outcome in ("ok", "partial") for event in rounds), \
                f"{rounds}\n{peer.warnings()}"
        # and the paused one counts nothing: no sample, no epoch, no round, while it is paused
        assert scrape(port_of(volunteer.metrics_url))[("peer_samples_total", ())] == samples_when_paused
        assert not any(isinstance(event, (EpochEnded, RoundEnded)) and event.time > paused.time
                       for event in volunteer.events)
        table = await peer_command(tmp_path, "status", "--json", "--initial-peers", first.address,
                                   "--run-owner", first.run_owner, "--timeout-seconds", "30")
        report = json.loads(table.stdout.splitlines()[-1])
        listed = {peer["peer_id"]: peer for peer in report["peers"]}
        assert listed[volunteer.peer_id]["paused"] == ["requested"] and listed[first.peer_id]["paused"] == []
        # credit: each training peer's claim, and what the other two accepted of its contributions
        credit = {row["peer_id"]: row for row in report["contributors"]}
        for peer in (first, second):
            assert credit[peer.peer_id]["claimed_samples"] > 0 and credit[peer.peer_id]["observed_samples"] > 0, credit

        done = await peer_command(tmp_path, "resume", "--checkpoint-dir", str(tmp_path / volunteer.name))
        assert done.returncode == 0 and "resumed" in done.stdout, done.stdout + done.stderr
        resumed = await volunteer.wait_for(Resumed, timeout=5, what="the resume")
        if resumed.downloaded:
            assert resumed.epoch >= goal - 1, resumed  # the swarm's state, not its own stale one
        else:  # under suite load every donor's digest of its epoch was still unpublished (CI): its next steps retry
            await volunteer.wait_for(StateDownloaded, lambda event: event.time >= resumed.time, timeout=180,
                                     what="the swarm's state after the resume")
        await volunteer.reach(max(first.epoch, second.epoch) + 2, timeout=120)  # training again, with the others
        swarm.end_soon(peers)
        assert await swarm.all_exited(timeout=150) == [0, 0, 0]

    states = [load_model_state(tmp_path / peer.name) for peer in peers]
    assert max_parameter_difference(states[0], states[1]) <= 1e-6
    assert max_parameter_difference(states[0], states[2]) <= 1e-6
    summary = json.loads((tmp_path / f"{volunteer.name}.json").read_text())
    # the summary counts the one pause, as long as its resumed event says it lasted
    assert summary["pauses"] == 1 and round(summary["paused_seconds"], 3) == resumed.paused_seconds


@pytest.mark.timeout(240)
async def test_a_peer_whose_only_partner_paused_trains_on_alone_without_waiting_for_a_group(tmp_path: Path):
    """The paused peer's progress record stays in the DHT (marked as paused): counted as a peer to average with, it
    made the other wait out matchmaking each epoch (averaging timeout 20 s here) and fail the round."""
    async with Swarm(tmp_path, "--task", "bytelm-tiny", "--target-batch-size", "48", "--min-peers", "2",
                     "--max-epochs", "200", fast=True) as swarm:
        peers = await swarm.start(2, *swarm.ends_on_request())
        first, volunteer = peers
        await swarm.all_reached(2, timeout=120)
        done = await peer_command(tmp_path, "pause", "--checkpoint-dir", str(tmp_path / volunteer.name))
        assert done.returncode == 0, done.stdout + done.stderr
        paused = await volunteer.wait_for(Paused, timeout=10, what="the pause")

        await first.reach(first.epoch + 6, timeout=90)  # a hang guard: 6 rounds that each waited would take 120 s
        since = next(i for i, event in enumerate(first.events) if isinstance(event, EpochEnded)
                     and event.epoch >= paused.epoch + 2)  # past any round the volunteer was in
        rounds = [event for event in first.events[since:] if isinstance(event, RoundEnded)]
        assert rounds and all(event.outcome == "skipped" for event in rounds), f"{rounds}\n{first.warnings()}"
        swarm.end_soon([first])
        assert await first.exit_code(timeout=120) == 0


@pytest.mark.timeout(240)
async def test_a_peer_yields_to_a_program_that_burns_the_cpu(tmp_path: Path):
    """Whatever else this machine runs, two burners outside the peer's processes make others use over 40% of it."""
    async with Swarm(tmp_path, "--task", "bytelm-tiny", "--target-batch-size", "48", fast=True) as swarm:
        peer = await swarm.add("--yield-when-busy", "--yield-cpu-share", "0.4", "--yield-after-seconds", "2")
        await peer.reach(1, timeout=120)
        burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
        try:
            paused = await peer.wait_for(Paused, lambda event: "busy" in event.reasons, timeout=60,
                                         what="a pause for the burners")
            assert paused.reasons["busy"].startswith("--yield-when-busy: other programs use CPU "), paused
        finally:
            for burner in burners:
                burner.kill()
                burner.wait(10)
        peer.terminate()  # a stop ends a pause like any other wait
        assert await peer.exit_code(timeout=90) == 0
