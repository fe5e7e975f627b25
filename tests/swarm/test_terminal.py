"""What a person sees running `peer start` in a terminal: a bar with log records above it, never in it, one
start line instead of the config, and a quiet Ctrl+C. The peer runs in a real pseudo-terminal."""
from __future__ import annotations

import os
import pty
import re
import select
import sys
import time
from pathlib import Path

import pytest

from peer.testing import FAST_ARGS, FAST_ENV
from tests.peers import REPO_ROOT

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
LOG_RECORD = re.compile(r"\d\d:\d\d:\d\d (DEBUG|INFO|WARNING|WARN|ERROR) ")


class Terminal:
    """A process whose controlling terminal, stdin, stdout and stderr are one pseudo-terminal."""

    def __init__(self, argv, cwd: Path, env: dict):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: exec at once (nothing else is safe after a fork)
            os.chdir(cwd)
            os.execve(argv[0], argv, env)
        self.output = b""

    def read_until(self, predicate, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not predicate(self.text()) and time.monotonic() < deadline:
            if not self._read(min(1.0, deadline - time.monotonic())):
                return predicate(self.text())
        return predicate(self.text())

    def _read(self, timeout: float) -> bool:
        """False once the process has closed the terminal."""
        ready, _, _ = select.select([self.fd], [], [], max(0.0, timeout))
        if ready:
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:  # EIO: every process holding the terminal exited
                return False
            if not chunk:
                return False
            self.output += chunk
        return True

    def text(self) -> str:
        return ANSI.sub("", self.output.decode(errors="replace"))

    def type(self, keys: bytes) -> None:
        os.write(self.fd, keys)

    def exit_code(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._read(0.2)
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                while self._read(0.2):  # what it wrote last
                    pass
                return os.waitstatus_to_exitcode(status)
        raise AssertionError(f"still running after {timeout:.0f}s:\n{self.text()[-3000:]}")

    def close(self) -> None:
        try:
            os.kill(self.pid, 9)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(self.fd)


@pytest.mark.timeout(240)
def test_a_peer_at_a_terminal_prints_logs_above_its_bar_and_stops_quietly_on_ctrl_c(tmp_path: Path):
    argv = [sys.executable, "-m", "peer", "start", "--task", "bytelm-tiny", "--target-batch-size", "32",
            *FAST_ARGS, "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--checkpoint-dir", str(tmp_path / "ckpt")]
    env = {**os.environ, **FAST_ENV, "PYTHONPATH": str(REPO_ROOT), "TERM": "xterm", "COLUMNS": "160"}
    terminal = Terminal(argv, tmp_path, env)
    try:
        # a bottleneck line comes about ten seconds in, while the bar is drawn: a log record during the bar
        assert terminal.read_until(lambda text: "epoch 3:" in text and "INFO monitoring.classifier" in text, 150), \
            terminal.text()[-3000:]
        terminal.type(b"\x03")  # Ctrl+C: SIGINT to the terminal's foreground process group
        assert terminal.exit_code(90) == 0, terminal.text()[-3000:]
    finally:
        terminal.close()

    text = terminal.text()
    assert "ERROR" not in text and "Traceback" not in text, text[-3000:]
    assert "samples toward the target batch" in text  # the bar was there
    for piece in re.split(r"[\r\n]+", text):  # a log record starts its own line, never after the bar's text
        match = LOG_RECORD.search(piece)
        assert match is None or match.start() == 0, piece
    assert "config: {" not in text  # one start line instead of the whole config
    assert re.search(r"swarmtrain \S+: run swarmtrain, task bytelm-tiny \([0-9.]+M parameters\) on cpu", text), text
    assert re.search(r"\d\d:\d\d:\d\d epoch 3: loss \S+  val_loss \S+  this peer [0-9.]+ samples/s  swarm [0-9.]+ "
                     r"samples/s  peers 1  took \d+", text), text
