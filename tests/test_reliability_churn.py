"""Peers die mid-round and come back; a bounded churn soak. Survivors never stall and stay equal."""
from __future__ import annotations

import json
import random
import signal
import time
from pathlib import Path

import psutil
import pytest

from peer.checkpoint import CheckpointStore
from peer.testing import max_parameter_difference
from tests.peers import FAST_SWARM_ARGS, load_model_state, session_processes, wait_until

pytestmark = pytest.mark.integration

AVERAGING_TIMEOUT_SECONDS = 10
MARGIN_SECONDS = 10  # start-up of a round, validation and a checkpoint can ride on top of the timeout


def swarm_args(tmp_path: Path, name: str, *extra: str) -> list:
    return ["start", *FAST_SWARM_ARGS, "--averaging-timeout-seconds", str(AVERAGING_TIMEOUT_SECONDS),
            "--target-batch-size", "48", "--checkpoint-every-epochs", "1",
            "--checkpoint-dir", str(tmp_path / name), "--summary-json", str(tmp_path / f"{name}.json"), *extra]


@pytest.mark.timeout(300)
def test_peer_killed_mid_round_survivors_go_on_and_it_catches_up_after_restart(spawn, tmp_path: Path):
    epochs = 19
    first = spawn("p0", *swarm_args(tmp_path, "p0", "--min-peers", "4", "--max-epochs", str(epochs)))
    address = first.join_address()
    others = [spawn(f"p{i}", *swarm_args(tmp_path, f"p{i}", "--min-peers", "4", "--max-epochs", str(epochs),
                                         "--initial-peers", address)) for i in (1, 2, 3)]
    victim, survivors = others[-1], [first, *others[:-1]]
    wait_until(lambda: victim.epoch() >= 4, 150, message="four epochs of a 4-peer swarm")

    # the tiny model's epochs are mostly matchmaking and all-reduce: a kill now lands mid-round
    victim.send(signal.SIGKILL)
    victim.wait(10)
    killed_at = max(peer.epoch() for peer in survivors)
    wait_until(lambda: min(peer.epoch() for peer in survivors) >= killed_at + 3, 90,
               message="the survivors to advance three more epochs")

    restarted = spawn("p3-again", *swarm_args(tmp_path, "p3", "--max-epochs", str(epochs), "--initial-peers", address))
    for peer in (*survivors, restarted):
        assert peer.wait(200) == 0, peer.log()[-3000:]

    log = restarted.log()
    assert "resumed from" in log
    summaries = [json.loads((tmp_path / f"p{i}.json").read_text()) for i in range(4)]
    for summary in summaries[:3]:
        assert summary["global_epoch"] == epochs
        assert summary["longest_step_seconds"] <= AVERAGING_TIMEOUT_SECONDS + MARGIN_SECONDS, summary
    assert summaries[3]["global_epoch"] == epochs and summaries[3]["resumed_from"] is not None
    states = [load_model_state(tmp_path / f"p{i}") for i in range(4)]
    # hivemind completes a round even when a part arrives late ("received 99.9% results"): the missing
    # slice keeps that peer's own values. With 4 peers and a kill that happens on a busy machine, so
    # equal here means equal to 1e-4 (seen: 4e-5), not bit-for-bit.
    for state in states[1:]:
        assert max_parameter_difference(states[0], state) <= 1e-4


@pytest.mark.timeout(600)
def test_churn_soak(spawn, tmp_path: Path, soak_seconds: float):
    """Peers are killed and restarted at random, at least 2 always alive."""
    rng = random.Random(0)
    names = ["s0", "s1", "s2"]
    first = spawn("s0-0", *swarm_args(tmp_path, "s0", "--min-peers", "2"))
    address = first.join_address()
    alive = {"s0": first}
    for name in names[1:]:
        alive[name] = spawn(f"{name}-0", *swarm_args(tmp_path, name, "--initial-peers", address))
    wait_until(lambda: all(p.epoch() >= 2 for p in alive.values()), 120, message="a trained swarm")
    rss_start = {name: psutil.Process(p.pid).memory_info().rss for name, p in alive.items()}
    restarts, dead, killed = {name: 0 for name in names}, {}, []
    epoch_marks = [max(p.epoch() for p in alive.values())]
    deadline = time.monotonic() + soak_seconds

    while time.monotonic() < deadline:
        time.sleep(rng.uniform(4, 10))
        if dead and (len(alive) < 3 and rng.random() < 0.6 or len(alive) == 2):
            name = rng.choice(sorted(dead))
            dead.pop(name)
            restarts[name] += 1
            alive[name] = spawn(f"{name}-{restarts[name]}", *swarm_args(tmp_path, name, "--initial-peers", address))
        elif len(alive) > 2:
            name = rng.choice(sorted(n for n in alive if n != "s0"))  # s0 holds the address the others join
            victim = alive.pop(name)
            victim.send(rng.choice([signal.SIGKILL, signal.SIGTERM]))
            victim.wait(40)
            dead[name] = victim
            killed.append(victim)
        epoch_marks.append(max(p.epoch() for p in alive.values()))

    assert epoch_marks[-1] > epoch_marks[0] + 5, epoch_marks
    survivors_rss = {name: psutil.Process(p.pid).memory_info().rss for name, p in alive.items() if name in rss_start}
    # a peer restarted a moment ago may still be importing torch, before its SIGTERM handler exists
    wait_until(lambda: all(p.events() for p in alive.values()), 90, message="every peer to be up (its ready event)")
    for peer in alive.values():
        peer.send(signal.SIGTERM)
    for name, peer in alive.items():
        assert peer.wait(40) == 0, f"{name} did not exit cleanly:\n{peer.log()[-2000:]}"
    for name, rss in survivors_rss.items():  # hivemind is known to leak on failed rounds: bound the growth
        assert rss - rss_start[name] < 300 * 2**20, f"{name} grew by {(rss - rss_start[name]) / 2**20:.0f} MiB"
    for victim in killed:  # killed or stopped, a peer leaves no child behind
        wait_until(lambda victim=victim: not session_processes(victim.pid), 20,
                   message=f"the children of {victim.pid} to exit")
    for name in names:
        store = CheckpointStore(tmp_path / name)
        assert store.list(), f"{name} has no checkpoint"
        assert store.load_latest().path == store.list()[-1], f"{name}'s newest checkpoint is corrupt"
