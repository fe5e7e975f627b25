"""`peer bootstrap` and `peer status` against real swarms of `peer` processes on 127.0.0.1."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

from peer.testing import Swarm, until
from tests.http import get
from tests.peers import REPO_ROOT, free_port

UNREACHABLE = "/ip4/127.0.0.1/tcp/1/p2p/QmZurcthsZnDEsqwnnY67QJW6mAXMS3VayxHZMFQ6QHNKX"
PYTHON_START_SECONDS = 30.0  # importing torch and hivemind on a busy 2-core machine


def run_peer(cwd: Path, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """Run `peer <args>` to completion (killed after `timeout`: the test then fails, it never hangs)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "peer", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=timeout)


@pytest.mark.timeout(240)
async def test_status_lists_both_peers_of_a_keyed_swarm_with_its_progress_and_manifest(tmp_path: Path):
    """With --swarm-key, progress records and the manifest live under keyed names: status reads them there."""
    key = tmp_path / "swarm.key"
    key.write_text("a-shared-secret-for-the-swarm")
    async with Swarm(tmp_path, "--task", "bytelm-tiny", "--target-batch-size", "256", "--min-peers", "2",
                     "--max-seconds", "180", "--swarm-key", str(key), fast=True) as swarm:
        first, second = await swarm.start(2)
        await check_status_of_keyed_swarm(tmp_path, key, first.address, first.run_owner)


async def check_status_of_keyed_swarm(tmp_path: Path, key: Path, address: str, run_owner: str) -> None:
    report = {}

    def both_listed() -> bool:
        nonlocal report
        done = run_peer(tmp_path, "status", "--json", "--initial-peers", address, "--target-batch-size", "256",
                        "--swarm-key", str(key), "--timeout-seconds", "20", timeout=20 + PYTHON_START_SECONDS)
        assert done.returncode == 0, done.stderr[-3000:]
        report = json.loads(done.stdout)
        return len(report["peers"]) == 2 and report["swarm"]["training_peers"] >= 1

    await until(both_listed, 150, "peer status to list both peers", interval=1.0)
    swarm, peers = report["swarm"], report["peers"]
    assert swarm["peers"] == 2 and swarm["run_id"] == "swarmtrain" and swarm["target_batch_size"] == 256
    assert swarm["training_peers"] >= 1  # hivemind's progress record: peers that reported samples
    assert swarm["global_epoch"] >= 0 and 0.0 <= swarm["progress"] <= 1.0
    assert swarm["eta_next_epoch_seconds"] is not None
    assert report["manifest"]["settings"]["task"] == "bytelm-tiny"
    assert report["manifest"]["settings"]["target_batch_size"] == 256
    # signed by the first peer, which started the run; the joiner keeps a copy too
    assert report["manifest"]["owner"] == run_owner and report["manifest"]["held_by_peers"] == 2
    assert swarm["samples_per_second"] == pytest.approx(sum(peer["samples_per_second"] for peer in peers), abs=0.01)
    assert len({peer["peer_id"] for peer in peers}) == 2
    assert any(address.endswith("/p2p/" + peer["peer_id"]) for peer in peers)  # the first peer is one of them
    for peer in peers:
        assert peer["short_id"] == peer["peer_id"][-8:]
        assert peer["device"] == "cpu" and peer["client_mode"] is False
        assert peer["samples_per_second"] >= 0 and peer["epoch"] >= 0
        assert 0 <= peer["last_seen_seconds"] < 30  # records live 15 s, so a listed peer is a live one
        assert peer["bottleneck"] is None or isinstance(peer["bottleneck"], str)

    table = run_peer(tmp_path, "status", "--initial-peers", address, "--target-batch-size", "256",
                     "--swarm-key", str(key), timeout=20 + PYTHON_START_SECONDS)
    assert table.returncode == 0, table.stderr[-3000:]
    for peer in peers:
        assert peer["short_id"] in table.stdout
    assert "swarm: 2 peers" in table.stdout and "/256 samples" in table.stdout
    assert f"signed by run owner {run_owner}, held by 2 live peers" in table.stdout
    assert "task bytelm-tiny" in table.stdout

    # without the key, the peers are listed (PeerInfo records are open) but not the progress or the manifest
    blind = run_peer(tmp_path, "status", "--json", "--initial-peers", address, "--target-batch-size", "256",
                     "--timeout-seconds", "20", timeout=20 + PYTHON_START_SECONDS)
    assert blind.returncode == 0, blind.stderr[-3000:]
    blind = json.loads(blind.stdout)
    assert blind["manifest"] is None and len(blind["peers"]) == 2
    assert blind["swarm"]["training_peers"] == 0 and blind["swarm"]["eta_next_epoch_seconds"] is None


@pytest.mark.timeout(120)
def test_status_exits_1_with_one_line_when_the_swarm_is_unreachable(tmp_path: Path):
    done = run_peer(tmp_path, "status", "--initial-peers", UNREACHABLE, "--timeout-seconds", "5",
                    timeout=5 + PYTHON_START_SECONDS)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("error: could not reach the swarm via " + UNREACHABLE)
    assert done.stdout == ""


@pytest.mark.timeout(150)
async def test_unreachable_initial_peer_fails_after_bounded_retries(tmp_path: Path):
    attempts, timeout_seconds = 2, 5
    bound = attempts * timeout_seconds + 1  # one backoff of 1 s between the two attempts
    async with Swarm(tmp_path) as swarm:
        node = swarm.run("bootstrap", "--initial-peers", UNREACHABLE, "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                         "--startup-attempts", str(attempts), "--startup-timeout-seconds", str(timeout_seconds),
                         name="boot")
        exited = await node.exited(timeout=bound + PYTHON_START_SECONDS)
        assert (exited.code, exited.reason) == (1, "failed"), node.log_tail()
        await until(lambda: not node.session_processes(), 15, "no process of the failed node to remain")
    log = node.log()  # what the operator reads
    assert "DHT start attempt 1/2 failed" in log
    [error] = [line for line in log.splitlines() if "could not join the swarm" in line]
    assert f"after {attempts} attempts" in error and UNREACHABLE in error and "last error: " in error


@pytest.mark.timeout(120)
async def test_a_peer_stopped_while_it_joins_exits_0_without_waiting_out_the_attempt(tmp_path: Path):
    # a listener that accepts and never answers: each attempt to join through it lasts until p2pd gives up (~5 s)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        address = f"/ip4/127.0.0.1/tcp/{silent.getsockname()[1]}/p2p/QmZurcthsZnDEsqwnnY67QJW6mAXMS3VayxHZMFQ6QHNKX"
        port = free_port()
        async with Swarm(tmp_path, "--task", "bytelm-tiny", fast=True) as swarm:
            peer = await swarm.add("--initial-peers", address, "--startup-timeout-seconds", "30",
                                   "--metrics-port", str(port), join=False, ready=False)
            # its metrics server starts just before it joins
            await until(lambda: get(port, "/healthz")[0] != 0, PYTHON_START_SECONDS, "the peer to start joining")
            peer.terminate()
            exited = await peer.exited(timeout=30)
            assert (exited.code, exited.reason) == (0, "signal:SIGTERM"), peer.log_tail()
            await until(lambda: not peer.session_processes(), 15, "no process of the stopped peer to remain")
    assert "DHT start attempt" not in peer.log(), "the attempt under way was waited out (and retried) instead of " \
                                                  "abandoned"


@pytest.mark.timeout(300)
async def test_peers_that_know_only_the_bootstrap_node_find_each_other_and_average(tmp_path: Path):
    maddrs_file = tmp_path / "bootstrap-maddrs.txt"
    async with Swarm(tmp_path, "--task", "bytelm-tiny", "--target-batch-size", "32", "--min-peers", "2",
                     "--max-epochs", "3", fast=True) as swarm:
        boot = await swarm.bootstrap("--identity", str(tmp_path / "bootstrap.key"), "--write-maddrs", str(maddrs_file))
        maddrs: List[str] = maddrs_file.read_text().splitlines()  # written before it says it is ready
        assert maddrs and all(maddr.startswith("/ip4/127.0.0.1/tcp/") for maddr in maddrs)
        assert boot.events[0].role == "bootstrap" and boot.events[0].multiaddrs == maddrs
        assert maddrs[0] in boot.log()  # printed for people, too

        peers = [await swarm.add("--initial-peers-file", str(maddrs_file), join=False, name=name) for name in "ab"]
        assert await swarm.all_exited(timeout=200) == [0, 0]
        for peer in peers:
            summary = json.loads((tmp_path / f"{peer.name}.json").read_text())
            assert summary["global_epoch"] == 3 and summary["averaging_rounds"]["ok"] >= 1, summary

        boot.terminate()
        exited = await boot.exited(timeout=30)
        assert exited.code == 0, boot.log_tail()
        await until(lambda: not boot.session_processes(), 15, "every child of the bootstrap node to exit")
    assert "Traceback" not in boot.log()
