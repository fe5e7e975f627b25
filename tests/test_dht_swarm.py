"""`peer bootstrap` and `peer status` against real swarms of `peer` processes on 127.0.0.1."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

from peer.events import Exited, Ready
from peer.testing import session_processes
from tests.peers import REPO_ROOT, start_peer, wait_until

pytestmark = pytest.mark.integration

UNREACHABLE = "/ip4/127.0.0.1/tcp/1/p2p/QmZurcthsZnDEsqwnnY67QJW6mAXMS3VayxHZMFQ6QHNKX"
PYTHON_START_SECONDS = 30.0  # importing torch and hivemind on a busy 2-core machine


def run_peer(cwd: Path, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """Run `peer <args>` to completion (killed after `timeout`: the test then fails, it never hangs)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "peer", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=timeout)


@pytest.mark.timeout(240)
def test_status_lists_both_peers_of_a_keyed_swarm_with_its_progress_and_manifest(spawn, tmp_path: Path):
    """With --swarm-key, progress records and the manifest live under keyed names: status reads them there."""
    key = tmp_path / "swarm.key"
    key.write_text("a-shared-secret-for-the-swarm")
    common = ["--target-batch-size", "256", "--min-peers", "2", "--max-seconds", "180", "--swarm-key", str(key)]
    first = start_peer(spawn, tmp_path, "a", *common)
    address = first.join_address()
    start_peer(spawn, tmp_path, "b", *common, "--initial-peers", address)

    report = {}

    def both_listed() -> bool:
        nonlocal report
        done = run_peer(tmp_path, "status", "--json", "--initial-peers", address, "--target-batch-size", "256",
                        "--swarm-key", str(key), "--timeout-seconds", "20", timeout=20 + PYTHON_START_SECONDS)
        assert done.returncode == 0, done.stderr[-3000:]
        report = json.loads(done.stdout)
        return len(report["peers"]) == 2 and report["swarm"]["training_peers"] >= 1

    wait_until(both_listed, 150, interval=1.0, message="peer status to list both peers")
    swarm, peers = report["swarm"], report["peers"]
    assert swarm["peers"] == 2 and swarm["run_id"] == "swarmtrain" and swarm["target_batch_size"] == 256
    assert swarm["training_peers"] >= 1  # hivemind's progress record: peers that reported samples
    assert swarm["global_epoch"] >= 0 and 0.0 <= swarm["progress"] <= 1.0
    assert swarm["eta_next_epoch_seconds"] is not None
    assert report["manifest"]["settings"]["task"] == "bytelm-tiny"
    assert report["manifest"]["settings"]["target_batch_size"] == 256
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
    assert "manifest (protocol" in table.stdout and "task bytelm-tiny" in table.stdout

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
def test_unreachable_initial_peer_fails_after_bounded_retries(spawn, tmp_path: Path):
    attempts, timeout_seconds = 2, 5
    node = spawn("boot", "bootstrap", "--initial-peers", UNREACHABLE, "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                 "--startup-attempts", str(attempts), "--startup-timeout-seconds", str(timeout_seconds))
    bound = attempts * timeout_seconds + 1  # one backoff of 1 s between the two attempts
    assert node.wait(bound + PYTHON_START_SECONDS) == 1, node.log()[-3000:]
    log = node.log()
    assert "DHT start attempt 1/2 failed" in log
    [error] = [line for line in log.splitlines() if "could not join the swarm" in line]
    assert f"after {attempts} attempts" in error and UNREACHABLE in error and "last error: " in error
    wait_until(lambda: not session_processes(node.pid), 15, message="no process of the failed node to remain")


@pytest.mark.timeout(120)
def test_a_peer_stopped_while_it_joins_exits_0_without_waiting_out_the_attempt(spawn, tmp_path: Path):
    # a listener that accepts and never answers: each attempt to join through it lasts until p2pd gives up (~5 s)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        address = f"/ip4/127.0.0.1/tcp/{silent.getsockname()[1]}/p2p/QmZurcthsZnDEsqwnnY67QJW6mAXMS3VayxHZMFQ6QHNKX"
        peer = start_peer(spawn, tmp_path, "joiner", "--initial-peers", address, "--startup-timeout-seconds", "30")
        wait_until(lambda: "metrics on" in peer.log(), PYTHON_START_SECONDS, message="the peer to start joining")
        peer.send(signal.SIGTERM)
        assert peer.wait(30) == 0, peer.log()[-3000:]
    log = peer.log()
    assert "peer stopped (signal:SIGTERM)" in log
    assert "DHT start attempt" not in log, "the attempt under way was waited out (and retried) instead of abandoned"
    wait_until(lambda: not session_processes(peer.pid), 15, message="no process of the stopped peer to remain")


@pytest.mark.timeout(300)
def test_peers_that_know_only_the_bootstrap_node_find_each_other_and_average(spawn, tmp_path: Path):
    maddrs_file = tmp_path / "bootstrap-maddrs.txt"
    identity = tmp_path / "bootstrap.key"
    boot = spawn("boot", "bootstrap", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--identity", str(identity),
                 "--write-maddrs", str(maddrs_file))
    wait_until(lambda: maddrs_file.exists() or boot.process.poll() is not None, 90, message="the maddrs file")
    assert maddrs_file.exists(), boot.log()[-3000:]
    maddrs: List[str] = maddrs_file.read_text().splitlines()
    assert maddrs and all(maddr.startswith("/ip4/127.0.0.1/tcp/") for maddr in maddrs)
    # printed at start, too: just after the file is written, so the log may lag the file by a moment
    wait_until(lambda: maddrs[0] in boot.log(), 10, message="the bootstrap node to print its multiaddrs")

    common = ["--target-batch-size", "32", "--min-peers", "2", "--max-epochs", "3",
              "--initial-peers-file", str(maddrs_file)]
    peers = [start_peer(spawn, tmp_path, name, *common) for name in ("a", "b")]
    for peer in peers:
        assert peer.wait(200) == 0, peer.log()[-4000:]
    summaries = [json.loads((tmp_path / f"{name}.json").read_text()) for name in ("a", "b")]
    assert summaries[0]["global_epoch"] == summaries[1]["global_epoch"] == 3
    for summary in summaries:
        assert summary["averaging_rounds"]["ok"] >= 1, summary

    boot.send(signal.SIGTERM)
    assert boot.wait(30) == 0, boot.log()[-3000:]
    assert "Traceback" not in boot.log()
    wait_until(lambda: not session_processes(boot.pid), 15, message="every child of the bootstrap node to exit")
    ready, exited = boot.events()  # its events file: the same addresses, then a clean exit
    assert isinstance(ready, Ready) and ready.role == "bootstrap" and ready.multiaddrs == maddrs
    assert isinstance(exited, Exited) and exited.code == 0
