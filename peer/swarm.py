"""`peer swarm`: N peers on this machine, for trying things out and for tests.

Peer 0 starts the swarm; the others are started once it prints its address, and join it.
Each peer is a `peer start` subprocess with its own checkpoint subdirectory, metrics port
and summary file; its output is prefixed with its name. With `--gpus`, one peer per GPU, each on its own
(`--device cuda:N`). A signal to this process is passed
on to every peer (a second one kills them), and every peer is told to stop (SIGTERM, via
the parent-death signal) if this process dies. Exits non-zero if any peer failed.
"""
from __future__ import annotations

import ctypes
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import List, Optional, Sequence

import click

from peer.config import PeerConfig
from peer.exit_codes import ExitCode

JOIN_LINE = re.compile(r"--initial-peers (\S+)")
BOOTSTRAP_TIMEOUT_SECONDS = 180.0
STOP_GRACE_SECONDS = 45.0
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Runs in each child before exec: SIGTERM it (a graceful stop) if `peer swarm` dies."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class LocalPeer:
    def __init__(self, index: int, args: List[str]):
        self.name = f"peer-{index}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "peer", "start", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            bufsize=1,
            preexec_fn=_die_with_parent,
        )
        self.join_address: Optional[str] = None
        self.address_seen = threading.Event()
        self._reader = threading.Thread(target=self._relay_output, name=f"{self.name}-output", daemon=True)
        self._reader.start()

    def _relay_output(self) -> None:
        for line in self.process.stdout:
            click.echo(f"[{self.name}] {line.rstrip()}")
            match = JOIN_LINE.search(line)
            if match and self.join_address is None:
                self.join_address = match.group(1)
                self.address_seen.set()
        self.address_seen.set()  # the process ended: stop waiting for an address

    def signal(self, signum: int) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signum)

    def wait(self, timeout: float) -> Optional[int]:
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None


def choose_gpus(spec: str, gpu_count: int) -> List[int]:
    """`--gpus all` or `--gpus 0,2` -> the GPU indices, one peer each.

    :raises ValueError: one line naming the value, the rule and a fix
    """
    gpus: Optional[List[int]] = None
    if spec.strip() != "all":
        try:
            gpus = [int(part) for part in spec.split(",")]
        except ValueError:
            raise ValueError(f"--gpus {spec!r}: give 'all' or GPU indices separated by commas, such as 0,1") from None
        if len(set(gpus)) != len(gpus):
            raise ValueError(f"--gpus {spec}: a GPU is listed twice; give each index once")
    if gpu_count == 0:
        raise ValueError(f"--gpus {spec}: this machine has no CUDA device that torch can use; leave out --gpus to "
                         f"run the peers on the CPU")
    if gpus is None:
        return list(range(gpu_count))
    missing = [gpu for gpu in gpus if not 0 <= gpu < gpu_count]
    if missing:
        raise ValueError(f"--gpus {spec}: no GPU {missing[0]}; this machine has GPUs 0 to {gpu_count - 1}")
    return gpus


def peer_args(config: PeerConfig, base_args: List[str], index: int, summary_dir: Optional[Path],
              gpus: Sequence[int] = ()) -> List[str]:
    """Per-peer overrides appended after the user's flags (the last occurrence of a flag wins)."""
    args = list(base_args)
    if gpus:
        args += ["--device", f"cuda:{gpus[index]}"]
    port = config.monitoring.metrics_port
    args += ["--metrics-port", str(port + index if isinstance(port, int) and port else port)]
    args += ["--checkpoint-dir", str(config.checkpoint.checkpoint_dir / f"peer-{index}")]
    args += ["--seed", str(config.training.seed + index)]  # each peer sees its own data order
    if config.dht.identity is not None:  # one key per peer: two peers with one identity would clash
        args += ["--identity", f"{config.dht.identity}.peer-{index}"]
    if "--host-maddrs" not in base_args:
        args += ["--host-maddrs", "/ip4/127.0.0.1/tcp/0"]
    if summary_dir is not None:
        args += ["--summary-json", str(summary_dir / f"peer-{index}.json")]
    return args


def run_local_swarm(config: PeerConfig, num_peers: int, summary_dir: Optional[Path], base_args: List[str],
                    gpus: Sequence[int] = ()) -> int:
    peers: List[LocalPeer] = []
    stopping = threading.Event()

    def on_signal(signum, frame) -> None:
        if stopping.is_set():
            for peer in peers:
                peer.signal(signal.SIGKILL)
            return
        stopping.set()
        click.echo(f"[swarm] {signal.Signals(signum).name}: stopping {len(peers)} peer(s)", err=True)
        for peer in peers:
            peer.signal(signal.SIGTERM)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    first = LocalPeer(0, peer_args(config, base_args, 0, summary_dir, gpus))
    peers.append(first)
    if config.dht.initial_peers:
        initial_peers = ",".join(config.dht.initial_peers)  # joining an existing swarm: everyone uses it
    else:
        first.address_seen.wait(BOOTSTRAP_TIMEOUT_SECONDS)
        if first.join_address is None:
            click.echo("[swarm] peer-0 exited or printed no address; not starting the others", err=True)
            on_signal(signal.SIGTERM, None)
            return _wait_all(peers)
        initial_peers = first.join_address
    for index in range(1, num_peers):
        if stopping.is_set():
            break
        args = peer_args(config, base_args, index, summary_dir, gpus) + ["--initial-peers", initial_peers]
        peers.append(LocalPeer(index, args))
    return _wait_all(peers)


def _wait_all(peers: List[LocalPeer]) -> int:
    """Wait for every peer; a peer that fails makes the swarm's exit code 1."""
    codes = {}
    while len(codes) < len(peers):
        for peer in peers:
            if peer.name not in codes:
                code = peer.wait(timeout=0.5)
                if code is not None:
                    codes[peer.name] = code
                    click.echo(f"[swarm] {peer.name} exited with code {code}", err=True)
    failed = [name for name, code in codes.items() if code != 0]
    if failed:
        click.echo(f"[swarm] failed: {', '.join(failed)}", err=True)
        return ExitCode.FAILED
    return ExitCode.OK
