"""The harness never signals a process that is not a peer's: a reaped peer's pid may be anyone's.

A test suite goes through Linux's 32768 pids in minutes (every thread takes one), so a peer that exited
early in a long test may, by the time the swarm is torn down, share its pid with a peer of another test.
"""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from peer.testing import Peer


async def test_a_reaped_peer_never_signals_the_process_that_got_its_pid(tmp_path: Path):
    peer = Peer("quick", "--help", [], tmp_path, events=False).start()
    assert await peer.exit_code(timeout=60) == 0  # its exit is collected: the pid is free
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        peer.process.pid = stranger.pid  # as if the system had given the stranger the peer's old pid
        assert peer.session_processes() == []
        peer.kill()
        peer.pause()
        peer.send(signal.SIGTERM)
        assert stranger.poll() is None, "the harness signalled a process that is not the peer's"
    finally:
        stranger.kill()
        stranger.wait(10)
    assert stranger.returncode == -signal.SIGKILL
