"""Peers die mid-round and come back; a bounded churn soak. Survivors never stall and stay equal."""
from __future__ import annotations

import asyncio
import json
import random
import signal
import time
from pathlib import Path

import psutil
import pytest

from peer.checkpoint.store import CheckpointStore
from peer.telemetry.events import Joined
from peer.testing import Peer, Swarm, max_parameter_difference

AVERAGING_TIMEOUT_SECONDS = 10


COMMON = ("--task", "bytelm-tiny", "--averaging-timeout-seconds", str(AVERAGING_TIMEOUT_SECONDS),
          "--target-batch-size", "48", "--checkpoint-every-epochs", "1")


async def no_process_left(peer: Peer, timeout: float) -> None:
    """Killed or stopped, a peer leaves no child behind: its session empties by itself."""
    deadline = time.monotonic() + timeout
    while peer.session_processes():
        assert time.monotonic() < deadline, f"children of {peer.name} outlived it: {peer.session_processes()}"
        await asyncio.sleep(0.2)


@pytest.mark.timeout(300)
async def test_peer_killed_mid_round_survivors_go_on_and_it_catches_up_after_restart(tmp_path: Path):
    async with Swarm(tmp_path, *COMMON, "--max-epochs", "40", fast=True) as swarm:  # only the bound: see end_soon
        swarm.args += swarm.ends_on_request()
        *survivors, victim = await swarm.start(4, "--min-peers", "4")
        await victim.reach(4, timeout=150)

        # the tiny model's epochs are mostly matchmaking and all-reduce: a kill now lands mid-round
        victim.send(signal.SIGKILL)  # the peer alone: its children notice and exit by themselves
        await victim.exit_code(timeout=10)
        await no_process_left(victim, 20)
        killed_at = max(peer.epoch for peer in survivors)
        await swarm.all_reached(killed_at + 3, timeout=90, peers=survivors)

        await victim.restart("--min-peers", "1")
        back = await victim.wait_for(Joined, timeout=90, what="the restarted peer to join again")
        await swarm.all_reached(back.epoch + 1, timeout=90)  # an epoch of all four after the restart
        epochs = min(40, swarm.end_soon(swarm.peers))
        assert await swarm.all_exited(timeout=200) == [0, 0, 0, 0]

        summaries = [json.loads((tmp_path / f"{peer.name}.json").read_text()) for peer in swarm.peers]
        for summary in summaries[:3]:  # the survivors went on (awaited above) and ended at the last epoch
            assert summary["global_epoch"] == epochs
        assert summaries[3]["global_epoch"] == epochs and summaries[3]["resumed_from"] is not None
        states = [peer.model_state() for peer in swarm.peers]
        # hivemind completes a round even when a part arrives late ("received 99.9% results"): the missing
        # slice keeps that peer's own values. With 4 peers and a kill that happens on a busy machine, so
        # equal here means equal to 1e-4 (seen: 4e-5), not bit-for-bit.
        for state in states[1:]:
            assert max_parameter_difference(states[0], state) <= 1e-4


@pytest.mark.timeout(600)
async def test_churn_soak(tmp_path: Path, soak_seconds: float):
    """Peers are killed and restarted at random, at least 2 always alive."""
    rng = random.Random(0)
    async with Swarm(tmp_path, *COMMON, fast=True) as swarm:
        alive = {"s0": await swarm.add("--min-peers", "2", name="s0")}
        for name in ("s1", "s2"):
            alive[name] = await swarm.add(name=name)
        await swarm.all_reached(2, timeout=120)
        rss_start = {name: psutil.Process(peer.pid).memory_info().rss for name, peer in alive.items()}
        dead = {}
        soak_began_at = max(peer.epoch for peer in alive.values())
        deadline = time.monotonic() + soak_seconds

        while time.monotonic() < deadline:
            await asyncio.sleep(rng.uniform(4, 10))
            if dead and (len(alive) < 3 and rng.random() < 0.6 or len(alive) == 2):
                name = rng.choice(sorted(dead))
                alive[name] = dead.pop(name).start()  # same checkpoint directory, joining s0 again
            elif len(alive) > 2:
                name = rng.choice(sorted(n for n in alive if n != "s0"))  # s0 holds the address the others join
                victim = alive.pop(name)
                victim.send(rng.choice([signal.SIGKILL, signal.SIGTERM]))
                await victim.exit_code(timeout=40)
                await no_process_left(victim, 20)
                dead[name] = victim

        # the swarm trains on through the churn: it gets 5 epochs past where the soak began, awaited rather than
        # timed (CI: a kill that landed mid-round cost two matchmaking windows, and 30 s of soak made only 4)
        await swarm.all_reached(soak_began_at + 6, timeout=180, peers=list(alive.values()))
        rss_end = {name: psutil.Process(peer.pid).memory_info().rss for name, peer in alive.items()}
        # a peer restarted a moment ago may still be importing torch, before its SIGTERM handler exists
        await asyncio.gather(*(peer.ready() for peer in alive.values()))
        for peer in alive.values():
            peer.terminate()
        for name, peer in alive.items():
            assert await peer.exit_code(timeout=40) == 0, f"{name} did not exit cleanly:\n{peer.log_tail(2000)}"
        for name, rss in rss_end.items():  # hivemind is known to leak on failed rounds: bound the growth
            assert rss - rss_start[name] < 300 * 2**20, f"{name} grew by {(rss - rss_start[name]) / 2**20:.0f} MiB"
        for peer in swarm.peers:
            store = CheckpointStore(peer.checkpoint_dir)
            assert store.list(), f"{peer.name} has no checkpoint"
            assert store.load_latest().path == store.list()[-1], f"{peer.name}'s newest checkpoint is corrupt"
