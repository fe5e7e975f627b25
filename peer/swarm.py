"""`peer swarm`: N peers on this machine, for trying things out and for tests.

Peer 0 starts the swarm; the others are started once its events file says it is ready, and join it.
Each peer is a `peer start` subprocess with its own checkpoint subdirectory, metrics port, events
file and summary file; its output is prefixed with its name. With `--gpus`, one peer per GPU, each on its own
(`--device cuda:N`). A signal to this process is passed
on to every peer (a second one kills them), and every peer is told to stop (SIGTERM, via
the parent-death signal) if this process dies. Exits non-zero if any peer failed.
"""
from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import List, Optional, Sequence

import click

from peer.config import PeerConfig
from peer.events import Ready, read_events
from peer.exit_codes import ExitCode

BOOTSTRAP_TIMEOUT_SECONDS = 180.0
STOP_GRACE_SECONDS = 45.0
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Runs in each child before exec: SIGTERM it (a graceful stop) if `peer swarm` dies."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class LocalPeer:
    def __init__(self, index: int, args: List[str], events_path: Path):
        self.name, self.events_path = f"peer-{index}", events_path
        # the file may hold an earlier run's events: only what this run appends counts
        self._events_offset = events_path.stat().st_size if events_path.is_file() else 0
        self.process = subprocess.Popen(
            [sys.executable, "-m", "peer", "start", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            bufsize=1,
            preexec_fn=_die_with_parent,
        )
        self._reader = threading.Thread(target=self._relay_output, name=f"{self.name}-output", daemon=True)
        self._reader.start()

    def _relay_output(self) -> None:
        for line in self.process.stdout:
            click.echo(f"[{self.name}] {line.rstrip()}")

    def join_address(self, timeout: float, stopping: threading.Event) -> Optional[str]:
        """Its address once its `ready` event is written; None if it exits, a stop comes, or time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not stopping.is_set():
            exited = self.process.poll() is not None
            events, _ = read_events(self.events_path, self._events_offset)
            ready = next((event for event in events if isinstance(event, Ready) and event.multiaddrs), None)
            if ready is not None:
                return ready.multiaddrs[0]
            if exited:
                return None
            stopping.wait(0.2)
        return None

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


def events_path(config: PeerConfig, index: int) -> Path:
    """Each peer's events file: <--events>.peer-N when --events is given, else next to its checkpoints."""
    if config.logging.events is not None:
        return Path(f"{config.logging.events}.peer-{index}")
    return config.checkpoint.checkpoint_dir / f"peer-{index}.events.jsonl"


def peer_args(config: PeerConfig, base_args: List[str], index: int, summary_dir: Optional[Path],
              gpus: Sequence[int] = ()) -> List[str]:
    """Per-peer overrides appended after the user's flags (the last occurrence of a flag wins)."""
    args = list(base_args)
    args += ["--events", str(events_path(config, index))]
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

    try:
        config.checkpoint.checkpoint_dir.mkdir(parents=True, exist_ok=True)  # where the events files go by default
    except OSError:
        pass  # peer 0 refuses the directory in one line, and exits
    first = LocalPeer(0, peer_args(config, base_args, 0, summary_dir, gpus), events_path(config, 0))
    peers.append(first)
    if config.dht.initial_peers:
        initial_peers = ",".join(config.dht.initial_peers)  # joining an existing swarm: everyone uses it
    else:
        initial_peers = first.join_address(BOOTSTRAP_TIMEOUT_SECONDS, stopping)
        if initial_peers is None:
            if not stopping.is_set():
                click.echo("[swarm] peer-0 exited or was not ready in time; not starting the others", err=True)
                on_signal(signal.SIGTERM, None)
            return _wait_all(peers)
    for index in range(1, num_peers):
        if stopping.is_set():
            break
        args = peer_args(config, base_args, index, summary_dir, gpus) + ["--initial-peers", initial_peers]
        peers.append(LocalPeer(index, args, events_path(config, index)))
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
