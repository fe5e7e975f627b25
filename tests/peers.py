"""Helpers for multi-peer tests: real `peer` processes on 127.0.0.1 that can never outlive a test.

Each process runs in its own session, its output goes to a log file, and every wait has a
timeout. The `peers` fixture (conftest.py) kills whatever is left, and asserts that no
child of a peer (DHT process, p2pd, averagers) survived it.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional

import psutil
import pytest
import torch

from peer.events import Event, Ready, latest_epoch, read_events
from peer.testing import FAST_ARGS

REPO_ROOT = Path(__file__).resolve().parents[1]
EVENT_WRITERS = ("start", "bootstrap")  # the commands that take --events

# Small, fast settings shared by the multi-peer tests.
FAST_SWARM_ARGS = ["--task", "bytelm-tiny", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", *FAST_ARGS]


def start_peer(spawn, tmp_path: Path, name: str, *extra: str, env: Optional[Dict[str, str]] = None) -> "PeerProcess":
    """`peer start` with the fast settings, its own checkpoint directory tmp_path/name and summary
    tmp_path/name.json."""
    return spawn(name, "start", *FAST_SWARM_ARGS, "--checkpoint-dir", str(tmp_path / name),
                 "--summary-json", str(tmp_path / f"{name}.json"), *extra, env=env)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def tmpfs(mount_point: Path, size: str, command_timeout_seconds: float = 30.0) -> Iterator[Path]:
    """A small tmpfs mounted at mount_point (an existing directory), lazily unmounted afterwards.

    Skips the test, saying why, where it cannot be mounted: it needs root on Linux."""
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        pytest.skip("needs root on Linux to mount a small tmpfs")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)],
                             capture_output=True, text=True, timeout=command_timeout_seconds)
    if mounted.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here: {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], capture_output=True, timeout=command_timeout_seconds)


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.2, message: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {message or predicate}")


class PeerProcess:
    """One `peer <command> ...` subprocess with its log in a file, and for `start` and `bootstrap` its events
    in another (log_path with .events.jsonl): state is learned from the events, the log is for people."""

    def __init__(self, log_path: Path, args: List[str], env: Optional[Dict[str, str]] = None):
        self.log_path = log_path
        self.events_path = log_path.with_suffix(".events.jsonl")
        if args and args[0] in EVENT_WRITERS:
            args = [*args, "--events", str(self.events_path)]
        self._log = open(log_path, "w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "peer", *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=log_path.parent,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO_ROOT), **(env or {})},
            start_new_session=True,
        )
        self.pid = self.process.pid

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def events(self) -> List[Event]:
        return read_events(self.events_path)[0]

    def ready(self, timeout: float = 90.0) -> Ready:
        """Its `ready` event: it is a member of the swarm."""
        def found() -> bool:
            if self.process.poll() is not None:
                raise RuntimeError(f"peer exited with {self.process.returncode}:\n{self.log()[-3000:]}")
            return any(isinstance(event, Ready) for event in self.events())

        wait_until(found, timeout, message=f"a ready event in {self.events_path}")
        return next(event for event in self.events() if isinstance(event, Ready))

    def epoch(self) -> int:
        """The newest global epoch it reported; -1 before it joined."""
        return latest_epoch(self.events())

    def join_address(self, timeout: float = 90.0) -> str:
        """What others pass as --initial-peers to join it."""
        return self.ready(timeout).multiaddrs[0]

    def send(self, signum: int) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signum)

    def wait(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"peer {self.pid} still running after {timeout:.0f}s:\n{self.log()[-3000:]}") from None

    def descendants(self) -> List[psutil.Process]:
        try:
            return psutil.Process(self.pid).children(recursive=True)
        except psutil.Error:
            return []

    def kill_everything(self, wait_seconds: float = 10.0) -> None:
        """Last resort: kill the whole session (the peer and everything it started), and reap it."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.process.wait(wait_seconds)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()


def load_model_state(checkpoint_dir: Path) -> Dict[str, torch.Tensor]:
    """Model tensors of the newest checkpoint in a peer's checkpoint directory."""
    from peer.checkpoint import CheckpointStore

    loaded = CheckpointStore(checkpoint_dir).load_latest()
    assert loaded is not None, f"no checkpoint in {checkpoint_dir}"
    return loaded.state["model"]
