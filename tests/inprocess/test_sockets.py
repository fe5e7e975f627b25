"""dht/sockets.py: hivemind's unix sockets live in a directory of the process's own, gone after it exits."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from dht.sockets import DIR_PREFIX, remove_stale_socket_dirs
from tests.peers import REPO_ROOT

A_PEER_S_DHT_AND_AVERAGER = """
import hivemind, torch
from hivemind.p2p import P2P
from dht.config import DHTConfig
from dht.node import shutdown_dht, start_dht
dht = start_dht(DHTConfig(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
averager = hivemind.averaging.DecentralizedAverager([torch.zeros(4)], dht, prefix="sockets", start=True)
print(P2P._UNIX_SOCKET_PREFIX, flush=True)
averager.shutdown()
shutdown_dht(dht)
"""


def test_a_process_that_ran_a_dht_and_an_averager_leaves_no_socket_file():
    short_tmp = Path(tempfile.mkdtemp(dir="/tmp"))  # pytest's tmp_path is too long for a socket path
    try:
        result = subprocess.run([sys.executable, "-c", A_PEER_S_DHT_AND_AVERAGER], capture_output=True, text=True,
                                timeout=120, cwd=REPO_ROOT, env={**os.environ, "TMPDIR": str(short_tmp)})
        assert result.returncode == 0, result.stderr[-3000:]
        prefix = result.stdout.strip().splitlines()[-1]
        assert prefix.startswith(f"/unix{short_tmp}/{DIR_PREFIX}")  # the sockets were made in the private directory
        assert list(short_tmp.iterdir()) == []  # and it is gone, sockets and all
    finally:
        shutil.rmtree(short_tmp, ignore_errors=True)


def test_only_directories_of_processes_that_no_longer_run_are_removed(tmp_path):
    dead, alive = tmp_path / f"{DIR_PREFIX}{2**22 + 12345}-abc", tmp_path / f"{DIR_PREFIX}{os.getpid()}-def"
    for path in (dead, alive):
        path.mkdir()
        (path / "hivemind-p2pd-x.sock").touch()
    remove_stale_socket_dirs(tmp_path)
    assert not dead.exists() and alive.exists()
