"""Helpers for the tests beside the asyncio harness (peer/testing/), which runs every peer process."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import pytest

from peer.testing import FAST_ARGS

REPO_ROOT = Path(__file__).resolve().parents[1]

# The harness's fast settings for a bytelm-tiny peer on 127.0.0.1, for the `peer swarm` and compose tests.
FAST_SWARM_ARGS = ["--task", "bytelm-tiny", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", *FAST_ARGS]


# Swarms of four or five peers that load the machine longest: pytest-xdist runs them one after another on one
# worker. Started together with the seven-peer hostile swarm (now `solo`) on the three workers, they were 16 peer
# processes on 2 cores, and all three failed: honest peers fell to 1-2 samples/s and out of step with their swarms.
ONE_CROWD_AT_A_TIME = pytest.mark.same_worker("crowded_swarms")


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

