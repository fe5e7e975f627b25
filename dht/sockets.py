"""A private directory for hivemind's unix sockets, removed when the process exits.

hivemind's p2p daemon and each of its clients (one per averager process) talk over unix sockets
named /tmp/hivemind-p2pd-*.sock and /tmp/hivemind-p2pclient-*.sock, which it leaves behind when a
process is terminated rather than shut down (every peer left two; a day of tests left hundreds).
Pointing hivemind at a directory of this process's own, and removing the directory at exit, leaves
nothing. A process killed outright cannot clean up: the next one removes directories of processes
that no longer run. The name carries the pid for that, and stays short: a socket path is limited
to 107 bytes.
"""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path
from typing import Dict

import psutil
from hivemind.p2p import P2P

DIR_PREFIX = "swarmtrain-p2p-"
MAX_DIR_CHARS = 107 - len("/hivemind-p2pclient-XXXXXXXXXXX.sock")  # a unix socket path has at most 107 bytes
_own_dirs: Dict[int, Path] = {}  # by pid: a forked child that starts a DHT of its own makes its own


def use_private_socket_dir() -> Path:
    """Once per process (before its first DHT starts): hivemind's sockets go to a directory of its own."""
    pid = os.getpid()
    if pid not in _own_dirs:
        parent = Path(tempfile.gettempdir())
        if len(str(parent / f"{DIR_PREFIX}{pid}-12345678")) > MAX_DIR_CHARS:
            parent = Path("/tmp")  # a long TMPDIR: where hivemind itself puts them
        remove_stale_socket_dirs(parent)
        _own_dirs[pid] = path = Path(tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{pid}-", dir=parent))
        atexit.register(shutil.rmtree, path, True)
        P2P._UNIX_SOCKET_PREFIX = f"/unix{path}/hivemind-"
    return _own_dirs[pid]


def remove_stale_socket_dirs(parent: Path) -> None:
    """Remove socket directories whose process no longer runs."""
    for path in parent.glob(f"{DIR_PREFIX}*-*"):
        pid = path.name[len(DIR_PREFIX):].split("-")[0]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
