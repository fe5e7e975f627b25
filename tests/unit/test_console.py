"""The terminal display (peer/telemetry/console.py): log records above the bar, and a forked process (hivemind's
DHT and averagers, data workers) that logs while the peer's threads hold the bar's locks."""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from peer.telemetry.console import ProgressDisplay


@pytest.fixture(autouse=True)
def a_terminal(monkeypatch):
    """rich draws the bar as it would on a terminal (pytest's stdout is not one)."""
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    monkeypatch.setenv("TTY_INTERACTIVE", "1")


@pytest.fixture
def root_logs_to(tmp_path: Path):
    """The root logger writing plain lines to a file (setup_logging has them go to stderr)."""
    root, path = logging.getLogger(), tmp_path / "stderr.log"
    saved = list(root.handlers)
    handler = logging.StreamHandler(path.open("a"))
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    root.handlers[:] = [handler]
    yield path
    root.handlers[:] = saved
    handler.stream.close()


def wait_for_exit(pid: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    raise AssertionError(f"the forked process was still logging after {timeout:.0f}s")


@pytest.mark.timeout(60)
def test_a_process_forked_while_the_bar_is_drawn_logs_to_stderr_without_waiting_for_the_bar(root_logs_to, capfd):
    display = ProgressDisplay(32, interactive=True)
    display.route_logs()
    drawing, forked = threading.Event(), threading.Event()

    def draw_the_bar():  # as rich's refresh thread, which holds the bar's lock while it redraws
        with display._progress.live._lock:
            drawing.set()
            forked.wait(30)

    drawer = threading.Thread(target=draw_the_bar, daemon=True)
    drawer.start()
    try:
        assert drawing.wait(30)
        pid = os.fork()
        if pid == 0:  # the child has the lock as it was: held, by a thread it does not have
            try:
                logging.getLogger("child").warning("a record from the forked process")
                print("a line printed to stderr", file=sys.stderr, flush=True)  # as Python's warnings are
            finally:
                os._exit(0)
        forked.set()
        assert wait_for_exit(pid, 30) == 0
    finally:
        forked.set()
        drawer.join(30)
        display.close()
    err = capfd.readouterr().err  # the process's own stderr, not the bar's console: in the peer, the terminal
    assert "child: a record from the forked process\n" in err and "a line printed to stderr\n" in err


def test_records_of_the_peer_itself_go_above_the_bar(root_logs_to: Path, capsys):
    display = ProgressDisplay(32, interactive=True)
    display.route_logs()
    try:
        logging.getLogger("peer").warning("a record of the peer")
    finally:
        display.close()
    assert "a record of the peer" in capsys.readouterr().out
    assert "a record of the peer" not in root_logs_to.read_text()
